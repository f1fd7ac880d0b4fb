#!/usr/bin/env bash
# The project's test command (README "Quick start", docs/testing.md; .ci/run calls it).
# Installs what the tests need on a fresh Debian machine (redis-server, nginx, haproxy, curl, openssl, nghttp, the
# Cyrus JMAP packages, Chromium + Node.js with playwright-core for the login page, jmap-jam, and
# jmapc in a Python venv), then runs format and lint checks and every test: unit, service, and integration tests
# that start real redis-server / nginx / Cyrus / tessera processes on free loopback ports, then
# every fuzz target for 20 s (scripts/fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v nginx >/dev/null || need+=(nginx)
command -v curl >/dev/null || need+=(curl)
command -v ip >/dev/null || need+=(iproute2) # network namespaces (tests/tls.rs, TCP Fast Open)
[ -x /usr/lib/cyrus/bin/master ] || need+=(cyrus-common cyrus-imapd)
[ -x /usr/lib/cyrus/bin/httpd ] || need+=(cyrus-caldav)
command -v saslpasswd2 >/dev/null || need+=(sasl2-bin)
command -v openssl >/dev/null || need+=(openssl)
# nghttp (nghttp2's HTTP/2 client) reads the h2c SETTINGS in tests/downstream.rs.
command -v nghttp >/dev/null || need+=(nghttp2-client)
# systemd-socket-activate passes listening sockets as systemd does (tests/tls.rs).
command -v systemd-socket-activate >/dev/null || need+=(systemd)
# HAProxy in TCP mode sends the PROXY protocol header (tests/proxy_protocol.rs).
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
# The system trust store: tessera's JWKS over https trusts it when token.jwks_ca is not set.
[ -s /etc/ssl/certs/ca-certificates.crt ] || need+=(ca-certificates)
[ -x /usr/bin/chromium ] || need+=(chromium)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
# PostgreSQL's server binaries (tests/postgres.rs starts its own clusters; pg_stat_statements ships
# with it).
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
# MariaDB's server and client (tests/mysql.rs starts its own servers).
command -v mariadbd >/dev/null || need+=(mariadb-server mariadb-client)
# jmapc (tests/cyrus_tls.rs) runs in a Python virtual environment.
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3 python3-venv)
if ((${#need[@]})); then
  echo "test.sh: installing ${need[*]}" >&2
  # Keep Debian's own services (nginx on :80, cyrus) from starting during install.
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# h2spec (RFC 9113 conformance, tests/hardening.rs), pinned, from the Go module proxy.
command -v h2spec >/dev/null || GOBIN=/usr/local/bin go install github.com/summerwind/h2spec/cmd/h2spec@v2.2.1+incompatible
# playwright-core (pinned in tests/browser/package-lock.json) drives Debian's Chromium; it never
# downloads a browser of its own.
[ -d tests/browser/node_modules/playwright-core ] || (cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)
# jmap-jam (pinned in tests/jmap/package-lock.json), a real JMAP client for tests/cyrus.rs.
[ -d tests/jmap/node_modules/jmap-jam ] || (cd tests/jmap && npm ci --no-audit --no-fund --loglevel=error)
# jmapc 0.4.0 and its dependencies (pinned in tests/jmap/requirements.txt), from PyPI.
[ -x tests/jmap/.venv/bin/python ] || {
  python3 -m venv tests/jmap/.venv
  tests/jmap/.venv/bin/pip install -q --disable-pip-version-check -r tests/jmap/requirements.txt
}
command -v cargo >/dev/null || { echo "test.sh: cargo not found; install Rust (rustup) first" >&2; exit 1; }
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy

# A clean clone gains nothing from incremental state, which would double the build's disk use.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo fmt --all -- --check
cargo clippy --all-targets -- -D warnings
# Every intra-doc link resolves, private items' docs included (a few seconds; module docs may
# name private items, which the private build shows).
RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
  cargo doc --no-deps --document-private-items --quiet
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# --no-fail-fast: a failing test binary does not hide what the others would have found.
tests=0
cargo test --all-targets --no-fail-fast 2>&1 | tee "$log" || tests=$?
# Every fuzz target for a bounded time (installs cargo-fuzz when missing; docs/testing.md), once
# every test has passed.
((tests != 0)) || FUZZ_SECONDS="${FUZZ_SECONDS:-20}" ./scripts/fuzz.sh
# One closing line over every test binary (cargo prints one "test result" line per target).
grep -E '^test result:' "$log" | awk '{p += $4; f += $6} END {printf "tests: %d passed, %d failed\n", p, f; exit (f > 0 || p == 0)}'
exit "$tests"
