// A page of another origin calling the API through tessera with a token, in a real headless
// Chromium (Debian's /usr/bin/chromium, driven by playwright-core): the browser's own preflight
// and CORS checks decide what the page may read.
// Usage: node cors.mjs API_URL ALLOWED_PAGE_URL OTHER_PAGE_URL TOKEN
// Walks: the allowed page -> a PUT with Authorization (preflighted) -> its answer and an exposed
// field read -> a request without a token, whose 401 the page reads -> the other origin's page ->
// the same PUT is refused by the browser.
// Prints one JSON line of findings last; exits 1 on the first failed check.
import { check, findings, launch } from './lib.mjs';

const [api, allowed, other, token] = process.argv.slice(2);

/// From the page at `page`, `fetch(url, init)`: its status, body and ETag, or the error's name.
async function fetchFrom(context, page, url, init) {
  const tab = await context.newPage();
  await tab.goto(page);
  const got = await tab.evaluate(async ([url, init]) => {
    try {
      const r = await fetch(url, init);
      return { status: r.status, body: await r.text(), etag: r.headers.get('etag') };
    } catch (e) {
      return { error: e.name };
    }
  }, [url, init]);
  await tab.close();
  return got;
}

const browser = await launch();
try {
  const context = await browser.newContext();
  const put = { method: 'PUT', headers: { Authorization: `Bearer ${token}`, 'Content-Type': 'application/json' }, body: '{}' };
  const granted = await fetchFrom(context, allowed, `${api}/api`, put);
  check('allowed_origin_reads_the_answer', granted.status === 200 && granted.body === 'api', JSON.stringify(granted));
  check('exposed_field_readable', granted.etag === '"v1"', JSON.stringify(granted));
  const refused = await fetchFrom(context, allowed, `${api}/api`, {});
  check('allowed_origin_reads_a_401', refused.status === 401, JSON.stringify(refused));
  const foreign = await fetchFrom(context, other, `${api}/api`, put);
  check('other_origin_refused_by_the_browser', foreign.error === 'TypeError', JSON.stringify(foreign));
} finally {
  await browser.close();
}
console.log(JSON.stringify(findings));
