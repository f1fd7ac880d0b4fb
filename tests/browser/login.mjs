// The login page in a real headless Chromium (Debian's /usr/bin/chromium, driven by playwright-core).
// Usage: node login.mjs BASE_URL SCREENSHOT_PATH
// Walks: protected page -> redirected to the login page (opened in a second tab too) -> wrong
// password in each tab (accessible error) -> right password -> back on the protected page
// through tessera -> log out -> refused again.
// Runs the whole flow with JavaScript disabled (the page must not need it), then checks the
// cookie attributes and that the old token is refused after logout. Prints one JSON line of
// findings; exits 1 on the first failed check.
import { check, findings, launch } from './lib.mjs';

const [base, screenshot] = process.argv.slice(2);
const browser = await launch();
try {
  const context = await browser.newContext({ javaScriptEnabled: false });
  const page = await context.newPage();

  await page.goto(`${base}/mail/inbox`);
  check('redirected_to_login', page.url() === `${base}/auth/login?rd=%2Fmail%2Finbox`, page.url());
  check('title', (await page.title()) === 'Sign in', await page.title());
  await page.screenshot({ path: screenshot, fullPage: true });

  // The login page opened again in another tab keeps this one's form good (its CSRF cookie
  // is not replaced): the next submit is answered for its password, not refused as forged.
  const other = await context.newPage();
  await other.goto(`${base}/auth/login`);

  // Accessible names: the inputs are found by their labels.
  await page.getByLabel('User name').fill('demo');
  await page.getByLabel('Password').fill('not-the-password');
  const [bad] = await Promise.all([
    page.waitForNavigation(),
    page.getByRole('button', { name: 'Sign in' }).click(),
  ]);
  check('wrong_password_401', bad.status() === 401, bad.status());
  const alert = page.getByRole('alert');
  check('error_is_announced', (await alert.textContent()).includes('wrong'), await alert.textContent());
  // Nor does the refusal's page replace it: the other tab's form is answered too.
  await other.getByLabel('User name').fill('demo');
  await other.getByLabel('Password').fill('not-the-password');
  const [otherBad] = await Promise.all([
    other.waitForNavigation(),
    other.getByRole('button', { name: 'Sign in' }).click(),
  ]);
  check('other_tab_answered', otherBad.status() === 401, otherBad.status());
  await other.close();

  await page.getByLabel('User name').fill('demo');
  await page.getByLabel('Password').fill('demo-password');
  await Promise.all([
    page.waitForURL(`${base}/mail/inbox`),
    page.getByRole('button', { name: 'Sign in' }).click(),
  ]);
  const heading = await page.getByRole('heading', { level: 1 }).textContent();
  check('protected_page_after_login', heading === 'Hello, demo', heading);
  check('upstream_got_basic', (await page.locator('#seen').textContent()).includes('Basic ZGVtbzpkZW1vLXBhc3N3b3Jk'));

  const cookies = await context.cookies(base);
  const token = cookies.find((c) => c.name === '__Host-tessera');
  check('cookie_set', !!token, JSON.stringify(cookies.map((c) => c.name)));
  check('cookie_attributes', token.httpOnly && token.secure && token.sameSite === 'Strict' && token.path === '/',
    JSON.stringify(token));

  const who = await context.request.get(`${base}/auth/session`);
  check('session_endpoint', who.status() === 200 && (await who.json()).sub === 'demo', who.status());

  await Promise.all([
    page.waitForURL(`${base}/auth/login`),
    page.getByRole('button', { name: 'Log out' }).click(),
  ]);
  const after = await context.cookies(base);
  check('cookie_cleared', !after.some((c) => c.name === '__Host-tessera'), JSON.stringify(after.map((c) => c.name)));

  await page.goto(`${base}/mail/inbox`);
  check('refused_after_logout', page.url().startsWith(`${base}/auth/login`), page.url());

  // The old token, replayed by hand, is refused too.
  const replay = await context.request.get(`${base}/mail/inbox`, {
    headers: { Authorization: `Bearer ${token.value}`, Accept: 'application/json' },
    maxRedirects: 0,
  });
  check('old_token_refused', replay.status() === 401, replay.status());
} finally {
  await browser.close();
}
console.log(JSON.stringify(findings));
