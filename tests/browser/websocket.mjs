// A WebSocket from a page in a real headless Chromium (Debian's /usr/bin/chromium, driven by
// playwright-core), through tessera, authenticated by the token cookie the browser sends with
// the handshake (a page's WebSocket cannot set `Authorization`).
// Usage: node websocket.mjs BASE_URL TOKEN (an https BASE_URL: the test CA's certificate is
// taken, and the WebSocket is wss:// on the page's HTTP/2 connection when tessera offers it)
// Walks: the page (same origin) -> WebSocket opens -> greeting and echo -> server ticks ->
// prints `ticking` and waits while the test revokes the session -> the socket must close.
// Prints one JSON line of findings last; exits 1 on the first failed check.
import { check, findings, launch } from './lib.mjs';

const [base, token] = process.argv.slice(2);
const browser = await launch();
try {
  const context = await browser.newContext({ ignoreHTTPSErrors: base.startsWith('https:') });
  const { hostname } = new URL(base);
  await context.addCookies([{ name: 'tessera', value: token, domain: hostname, path: '/', httpOnly: true, sameSite: 'Strict' }]);
  const page = await context.newPage();
  const resp = await page.goto(`${base}/page`);
  check('page_through_tessera', resp.status() === 200, resp.status());

  const opened = await page.evaluate(() => new Promise((resolve) => {
    const ws = new WebSocket(`${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/ws`);
    window.seen = [];
    window.ended = null;
    ws.onmessage = (e) => {
      window.seen.push(e.data);
      if (window.seen.length === 1) ws.send('hi');
      if (window.seen.length === 2) { ws.send('tick'); resolve(window.seen.slice()); }
    };
    ws.onclose = (e) => { window.ended = { code: e.code, reason: e.reason, clean: e.wasClean, at: performance.now() }; resolve(window.seen.slice()); };
    window.ws = ws;
  }));
  check('greeting_and_echo', opened[0] === 'hello alice' && opened[1] === 'alice: hi', JSON.stringify(opened));
  await page.waitForFunction(() => window.seen.filter((m) => m.startsWith('tick ')).length >= 3, null, { timeout: 5000 });
  check('ticks_arrive', true);

  const asked = await page.evaluate(() => performance.now());
  console.log('ticking');
  await page.waitForFunction(() => window.ended !== null, null, { timeout: 10000 })
    .catch(() => check('closed_after_revocation', false, 'still open 10 s after the revocation was asked'));
  const closed = await page.evaluate(() => window.ended);
  check('closed_after_revocation', true);
  // tessera tells the page why: a Close frame 1008 (policy violation) with the reason, and the
  // closing handshake completes (wasClean).
  check('close_code_1008', closed.code === 1008 && closed.reason === 'session revoked', JSON.stringify(closed));
  check('closed_cleanly', closed.clean === true, JSON.stringify(closed));
  findings.close_after_ms = Math.round(closed.at - asked);

  const again = await page.evaluate(() => new Promise((resolve) => {
    const ws = new WebSocket(`${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/ws`);
    ws.onopen = () => resolve('opened');
    ws.onerror = () => resolve('refused');
  }));
  check('refused_after_revocation', again === 'refused', again);
} finally {
  await browser.close();
}
console.log(JSON.stringify(findings));
