// Shared by the browser tests: the findings record and Debian's headless Chromium.
import { chromium } from 'playwright-core';

/// Findings by check name ('ok' or 'FAILED: detail'), printed as one JSON line.
export const findings = {};

/// Records one check; on a failure prints the findings so far and exits 1.
export function check(name, ok, detail) {
  findings[name] = ok ? 'ok' : `FAILED: ${detail ?? ''}`;
  if (!ok) {
    console.log(JSON.stringify(findings));
    process.exit(1);
  }
}

/// Launches /usr/bin/chromium headless, with no background traffic (loopback only).
export function launch() {
  return chromium.launch({
    executablePath: '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
}
