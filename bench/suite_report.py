#!/usr/bin/env python3
"""Turn a bench/suite.sh work directory into suite-<date>.json and suite-<date>.md.

Called by bench/suite.sh (not meant to be run by hand, though it can be re-run on a kept work
directory): reads WORK/runs.tsv (section, target, c, rep, id per wrk run), WORK/raw/<id>.txt (wrk
--latency output), <id>.redis0/.redis1 (INFO commandstats before/after), <id>.nginx0/.nginx1 (the
origin's stub_status before/after), <id>.maxopen (most upstream sockets open at once, close
section), WORK/close-closes.tsv (tessera-pool16's upstream connections closed by reason and
exchanges drained, per close run and over the section), WORK/revocation.json, WORK/memory.json, WORK/*-mem.txt, WORK/tok/aff-{many,few}.jsonl
(session counts of the affinity section); machine facts come from the environment suite.sh exports.

Per run: Redis commands = sum of `calls` deltas over every command but INFO (the snapshots' own
calls); upstream connections opened = origin `accepted` delta - 1 (the after-snapshot's own
connection). Per cell (target, concurrency): medians of req/s, p50, p99 over the repetitions;
Redis commands per request = all commands of all repetitions / all requests; upstream_conns = the
most opened in any repetition.

  python3 bench/suite_report.py --work DIR --json OUT.json --md OUT.md [--raw-name NAME]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _venv  # noqa: E402

_venv.ensure()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402

CLK_TCK = int(os.environ.get("CLK_TCK", "100"))
UNIT = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}
MATRIX_TARGETS = ["direct", "nginx-proxy", "python-ref", "tessera-redis", "tessera-embedded",
                  "tessera-busy"]
TESSERAS = ["tessera-redis", "tessera-embedded", "tessera-busy"]
# scaled section: the peers with one worker per CPU beside their one-worker runs.
SCALED_TARGETS = ["nginx-proxy", "nginx-proxy-mw", "python-ref", "python-ref-mw", "tessera-redis"]
ALGS = [("hs512", "HS512"), ("rs256", "RS256"), ("eddsa", "EdDSA")]
# affinity section: (instance, upstream.affinity), and the session sets (runs.tsv section suffix).
AFFINITY_TARGETS = [("tessera-redis", "none"), ("tessera-affinity", "session")]
AFFINITY_GROUPS = [("many", "SESSIONS"), ("few", "AFFINITY_FEW_SESSIONS")]


def to_us(text):
    m = re.fullmatch(r"([0-9.]+)(us|ms|s|m|h)", text)
    if not m:
        raise SystemExit(f"cannot parse latency {text!r}")
    return float(m.group(1)) * UNIT[m.group(2)]


def parse_wrk(path):
    t = open(path).read()
    rps = re.search(r"^Requests/sec:\s+([0-9.]+)", t, re.M)
    p50 = re.search(r"^\s+50%\s+(\S+)", t, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", t, re.M)
    reqs = re.search(r"^\s+(\d+) requests in", t, re.M)
    if not (rps and p50 and p99 and reqs):
        raise SystemExit(f"cannot parse wrk output {path}:\n{t}")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", t)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", t)
    return {
        "rps": float(rps.group(1)),
        "p50_us": to_us(p50.group(1)),
        "p99_us": to_us(p99.group(1)),
        "requests": int(reqs.group(1)),
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": sum(int(x) for x in sock.groups()) if sock else 0,
        "socket_errors_text": sock.group(0) if sock else "",
    }


def commandstats(path):
    calls = {}
    for line in open(path):
        m = re.match(r"cmdstat_([^:]+):calls=(\d+),", line.strip())
        if m:
            calls[m.group(1)] = int(m.group(2))
    return calls


def accepted(path):
    lines = open(path).read().split("\n")
    for i, line in enumerate(lines):
        if line.strip().startswith("server accepts"):
            return int(lines[i + 1].split()[0])
    raise SystemExit(f"cannot parse stub_status {path}")


def load_runs(work):
    runs = []
    for line in open(os.path.join(work, "runs.tsv")):
        if not line.strip():
            continue
        section, target, c, rep, rid = line.rstrip("\n").split("\t")
        raw = os.path.join(work, "raw")
        r = parse_wrk(os.path.join(raw, rid + ".txt"))
        before = commandstats(os.path.join(raw, rid + ".redis0"))
        after = commandstats(os.path.join(raw, rid + ".redis1"))
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        delta = {k: v for k, v in delta.items() if v and k != "info"}
        r.update(section=section, target=target, c=int(c), rep=int(rep), id=rid,
                 redis=delta, redis_total=sum(delta.values()),
                 origin_accepted=accepted(os.path.join(raw, rid + ".nginx1"))
                 - accepted(os.path.join(raw, rid + ".nginx0")) - 1)
        maxopen = os.path.join(raw, rid + ".maxopen")
        r["max_open"] = int(open(maxopen).read().strip() or 0) if os.path.exists(maxopen) else None
        cpu0, cpu1 = (os.path.join(raw, rid + ext) for ext in (".cpu0", ".cpu1"))
        r["cpu_s"] = (int(open(cpu1).read()) - int(open(cpu0).read())) / CLK_TCK \
            if os.path.exists(cpu0) and os.path.exists(cpu1) else None
        runs.append(r)
    return runs


def cell(runs, label, concurrency, client_side=False):
    """One row from the repetitions of one (target, concurrency)."""
    reqs = sum(r["requests"] for r in runs)
    redis = {}
    for r in runs:
        for k, v in r["redis"].items():
            redis[k] = redis.get(k, 0) + v
    total = sum(redis.values())
    # PING: the 1/s heartbeat of each tessera's invalidation connection, independent of traffic.
    per_req = sum(v for k, v in redis.items() if k != "ping")
    cpu = [r["cpu_s"] for r in runs if r["cpu_s"] is not None]
    conns = [r["origin_accepted"] for r in runs]
    row = {
        "target": label,
        "concurrency": concurrency,
        "rps": round(statistics.median(r["rps"] for r in runs), 1),
        "p50_ms": round(statistics.median(r["p50_us"] for r in runs) / 1e3, 4),
        "p99_ms": round(statistics.median(r["p99_us"] for r in runs) / 1e3, 4),
        "redis_cmds_per_req": round(total / reqs, 6) if reqs else None,
        "redis_cmds": redis,
        "redis_gets_per_req": round(redis.get("get", 0) / reqs, 6) if reqs else None,
        "redis_cmds_per_req_excl_ping": round(per_req / reqs, 6) if reqs else None,
        # CPU time of the target's own process (tessera, proxy.py, the nginx worker) per request.
        "cpu_us_per_req": round(sum(cpu) * 1e6 / reqs, 1) if reqs and cpu else None,
        # direct has no upstream: what the origin accepted there are wrk's own connections.
        "upstream_conns": None if client_side else max(conns),
        "origin_accepted_per_rep": conns,
        "requests": reqs,
        "non2xx": sum(r["non2xx"] for r in runs),
        "socket_errors": sum(r["socket_errors"] for r in runs),
        "reps": [{"rps": r["rps"], "p50_ms": round(r["p50_us"] / 1e3, 4),
                  "p99_ms": round(r["p99_us"] / 1e3, 4), "requests": r["requests"],
                  "redis": r["redis"], "origin_accepted": r["origin_accepted"],
                  "cpu_s": r["cpu_s"],
                  **({"max_open": r["max_open"]} if r["max_open"] is not None else {})}
                 for r in runs],
    }
    if any(r["max_open"] is not None for r in runs):
        row["max_open_upstream"] = max(r["max_open"] or 0 for r in runs)
    return row


def frac(a, b, digits=2):
    return round(a / b, digits) if a is not None and b else None


def session_count(work, group, env_name):
    path = os.path.join(work, "tok", f"aff-{group}.jsonl")
    if os.path.exists(path):
        return sum(1 for line in open(path) if line.strip())
    return int(os.environ.get(env_name) or 0) or None


def affinity_waits(work):
    """tessera-affinity's waits for a user's own connection, summed over the reps of each
    (section, c) from affinity-waits.tsv (section, c, rep, handovers, expired; the deltas of its
    metrics around each run): {(section, c): (handovers, expired)}."""
    path = os.path.join(work, "affinity-waits.tsv")
    sums = {}
    if os.path.exists(path):
        for line in open(path):
            section, c, _rep, handed, expired = line.split()
            h, e = sums.get((section, int(c)), (0, 0))
            sums[(section, int(c))] = (h + int(handed), e + int(expired))
    return sums


DRAIN_KEYS = ("drained", "drain_failed")


def close_counts(keys, fields):
    """One close-closes.tsv line's counts as {"closed": {reason: n}, "drained": n,
    "drain_failed": n}; dies on a line without every field."""
    if len(fields) != len(keys) + 2:
        sys.exit(f"close-closes.tsv: {len(fields)} fields, expected {len(keys) + 2}: {fields}")
    values = dict(zip(keys, map(int, fields[2:])))
    out = {"closed": {k: v for k, v in values.items() if k not in DRAIN_KEYS}}
    out.update({k: values.get(k, 0) for k in DRAIN_KEYS})
    return out


def close_closes(work):
    """tessera-pool16's closes by reason and drains from close-closes.tsv (a header line `c rep
    <keys...>`, then one line per close run and a last `all all` line for the whole section):
    a list of per-run {"concurrency", "rep", "closed": {reason: n}, "drained", "drain_failed"},
    and the section's counts in the same shape (None without the file or its `all` line)."""
    path = os.path.join(work, "close-closes.tsv")
    runs, section = [], None
    if os.path.exists(path):
        lines = [line.split() for line in open(path) if line.strip()]
        keys = lines[0][2:]
        for fields in lines[1:]:
            counts = close_counts(keys, fields)
            if fields[0] == "all":
                section = counts
            else:
                runs.append({"concurrency": int(fields[0]), "rep": int(fields[1]), **counts})
    return runs, section


def sum_closes(rows):
    """The counts of several runs added up, in close_counts' shape."""
    out = {"closed": {}, **{k: 0 for k in DRAIN_KEYS}}
    for r in rows:
        for k, v in r["closed"].items():
            out["closed"][k] = out["closed"].get(k, 0) + v
        for k in DRAIN_KEYS:
            out[k] += r[k]
    return out


def closes_text(counts):
    """`reason n, ...` for each close reason counted (or `none`), then the drains."""
    reasons = [f"{k} {v:,}" for k, v in counts["closed"].items() if v]
    return (f"{', '.join(reasons) or 'none'}; drained {counts['drained']:,}, "
            f"failed {counts['drain_failed']:,}")


def us(ms):
    x = ms * 1e3
    return f"{x:.0f} µs" if x < 10000 else f"{x / 1000:.1f} ms"


def cmds(row):
    v = row["redis_cmds_per_req"]
    return "n/a" if v is None else ("0" if v == 0 else f"{v:.4f}")


def cmds_np(row):
    v = row["redis_cmds_per_req_excl_ping"]
    return "n/a" if v is None else ("0" if v == 0 else f"{v:.4f}")


def cpu(row):
    v = row.get("cpu_us_per_req")
    return "n/a" if v is None else f"{v:.0f} µs"


def breakdown(row):
    b = row["redis_cmds"]
    return ", ".join(f"{k} {v}" for k, v in sorted(b.items(), key=lambda kv: -kv[1])) or "none"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("--raw-name", default="")
    args = p.parse_args()
    env = os.environ
    work = args.work
    runs = load_runs(work)
    by = {}
    for r in runs:
        by.setdefault((r["section"], r["target"], r["c"]), []).append(r)

    out = {"meta": {}, "matrix": [], "compat": [], "pinned": [], "scaled": [], "algs": [],
           "close": [], "revocation": None, "affinity": [], "memory": None}
    concs = sorted({r["c"] for r in runs if r["section"] == "matrix"})
    for c in concs:
        for t in MATRIX_TARGETS:
            if ("matrix", t, c) in by:
                out["matrix"].append(cell(by[("matrix", t, c)], t, c, client_side=t == "direct"))
    for c in sorted({r["c"] for r in runs if r["section"] == "compat"}):
        for t in ("direct", "nginx-proxy", "tessera-compat"):
            if ("compat", t, c) in by:
                out["compat"].append(cell(by[("compat", t, c)], t, c, client_side=t == "direct"))
    for t in MATRIX_TARGETS:
        if ("pinned", t, 1) in by:
            out["pinned"].append(cell(by[("pinned", t, 1)], t, 1, client_side=t == "direct"))
    for c in sorted({r["c"] for r in runs if r["section"] == "scaled"}):
        for t in SCALED_TARGETS:
            if ("scaled", t, c) in by:
                out["scaled"].append(cell(by[("scaled", t, c)], t, c))
    for key, name in ALGS:
        for t, mode in (("tessera-redis", "warm"), ("tessera-cold", "cold")):
            if (f"algs_{key}", t, 8) in by:
                row = cell(by[(f"algs_{key}", t, 8)], f"{name} {mode}", 8)
                row.update(alg=name, mode=mode, instance=t)
                out["algs"].append(row)
    close_runs, close_section = close_closes(work)
    for t, c in (("tessera-pool16", 8), ("nginx-proxy", 8), ("tessera-pool16", 64)):
        if ("close", t, c) in by:
            row = cell(by[("close", t, c)], f"{t} (Connection: close)", c)
            row["instance"] = t
            runs_c = sorted((r for r in close_runs if r["concurrency"] == c), key=lambda r: r["rep"])
            if t == "tessera-pool16" and runs_c:
                row["upstream_closed"] = sum_closes(runs_c)
                row["upstream_closed_per_rep"] = runs_c
            out["close"].append(row)
    if close_section:
        out["close_section_closed"] = close_section
    aff_concs = sorted({r["c"] for r in runs if r["section"].startswith("affinity_")})
    waits = affinity_waits(work)
    for c in aff_concs:
        for group, env_name in AFFINITY_GROUPS:
            count = session_count(work, group, env_name)
            base = None
            for t, mode in AFFINITY_TARGETS:
                if (f"affinity_{group}", t, c) not in by:
                    continue
                row = cell(by[(f"affinity_{group}", t, c)], f"{mode}, {count} sessions", c)
                row.update(affinity=mode, sessions=count, instance=t,
                           upstream_conns_per_1k_req=round(
                               sum(row["origin_accepted_per_rep"]) * 1000 / row["requests"], 2)
                           if row["requests"] else None)
                if (f"affinity_{group}", c) in waits and mode == "session":
                    row["handovers"], row["waits_expired"] = waits[(f"affinity_{group}", c)]
                if mode == "none":
                    base = row
                elif base:
                    # session / none, same session set and concurrency
                    row["vs_none"] = {
                        "rps": frac(row["rps"], base["rps"]),
                        "p50_ms": frac(row["p50_ms"], base["p50_ms"]),
                        "p99_ms": frac(row["p99_ms"], base["p99_ms"]),
                        "upstream_conns": frac(row["upstream_conns"], base["upstream_conns"], 1),
                        "cpu_us_per_req": frac(row["cpu_us_per_req"], base["cpu_us_per_req"]),
                    }
                out["affinity"].append(row)
    rev = os.path.join(work, "revocation.json")
    if os.path.exists(rev):
        out["revocation"] = json.load(open(rev))
    mem = os.path.join(work, "memory.json")
    if os.path.exists(mem):
        out["memory"] = json.load(open(mem))
    procmem = {}
    for name in ("matrix-mem.txt", "close-mem.txt", "affinity-mem.txt"):
        path = os.path.join(work, name)
        if os.path.exists(path):
            for line in open(path):
                parts = line.split()
                if len(parts) == 3:
                    procmem[parts[0]] = {"vmrss_kib": int(parts[1]), "vmhwm_kib": int(parts[2])}
    out["process_memory_after_load"] = procmem
    out["meta"] = {k: env.get(k, "") for k in (
        "WHEN", "BENCH_CMD", "DURATION", "REPS", "SECTIONS", "SESSIONS", "EMBEDDED_SESSIONS",
        "EMB_CREATE_S", "REVOCATION_TRIALS", "MEMORY_SESSIONS", "POOL_CAP",
        "AFFINITY_FEW_SESSIONS", "BUSY_POLL_US", "COMMIT", "BIN", "BIN_BUILT", "BIN_SHA256", "TESSERA_V", "NPROC", "CPU", "KERNEL",
        "IDLE", "MEM_TOTAL", "LOAD_START",
        "LOAD_END", "ELAPSED", "SECTION_TIMES", "NGINX_V", "WRK_V", "REDIS_V", "PY_V", "LOGS",
        "STALE", "PINNED_C1")}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")

    # ------------------------------------------------------------ Markdown
    M = {(r["target"], r["concurrency"]): r for r in out["matrix"]}
    md = []
    summary = []  # printed on stdout too

    if out["matrix"]:
        t = ["| target | c | req/s | p50 | p99 | Redis cmds/req (all / without PING) | "
             "upstream conns opened | CPU of the target process per request |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in out["matrix"]:
            conns = "n/a (no upstream)" if r["upstream_conns"] is None else \
                f"{r['upstream_conns']} (per rep: {', '.join(map(str, r['origin_accepted_per_rep']))})"
            t.append(f"| {r['target']} | {r['concurrency']} | {r['rps']:,.0f} | {us(r['p50_ms'])} "
                     f"| {us(r['p99_ms'])} | {cmds(r)} / {cmds_np(r)} | {conns} | {cpu(r)} |")
        md += ["## Matrix (medians)", ""] + t + [""]
        summary += t
        pairs = [(t_, b) for b in ("nginx-proxy", "python-ref") for t_ in TESSERAS]
        rt = ["| c | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |",
              "|---:|" + "---:|" * len(pairs)]
        for c in concs:
            def ratio(a, b):
                return f"{M[(a, c)]['rps'] / M[(b, c)]['rps']:.2f}x" \
                    if (a, c) in M and (b, c) in M else "n/a"
            rt.append(f"| {c} | " + " | ".join(ratio(a, b) for a, b in pairs) + " |")
        md += ["### req/s ratios", ""] + rt + [""]
        summary += [""] + rt
        if ("direct", 1) in M:
            lines = []
            for t_ in TESSERAS + ["nginx-proxy", "python-ref"]:
                if (t_, 1) in M:
                    d = (M[(t_, 1)]["p50_ms"] - M[("direct", 1)]["p50_ms"]) * 1e3
                    lines.append(f"- {t_} minus direct: **{d:+.0f} µs** "
                                 f"({us(M[(t_, 1)]['p50_ms'])} vs {us(M[('direct', 1)]['p50_ms'])})")
            md += ["### Added p50 at c=1", ""] + lines + [""]
            summary += [""] + lines
        bd = ["| target | c | requests | Redis commands (all reps, INFO excluded) | "
              "non-2xx | socket errors |", "|---|---:|---:|---|---:|---:|"]
        for r in out["matrix"]:
            bd.append(f"| {r['target']} | {r['concurrency']} | {r['requests']:,} | {breakdown(r)} | "
                      f"{r['non2xx']} | {r['socket_errors']} |")
        md += ["### Redis commands by name, errors", ""] + bd + [""]

    C = {(r["target"], r["concurrency"]): r for r in out["compat"]}
    if out["compat"]:
        t = ["| target | c | req/s | vs nginx-proxy | p50 | p99 | CPU of the target process per "
             "request | vs nginx-proxy | Redis cmds/req (without PING) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in out["compat"]:
            peer = C.get(("nginx-proxy", r["concurrency"]))
            vs = f"{r['rps'] / peer['rps']:.2f}x" if peer else "n/a"
            cpu_vs = f"{r['cpu_us_per_req'] / peer['cpu_us_per_req']:.2f}x" \
                if peer and r["cpu_us_per_req"] and peer["cpu_us_per_req"] else "n/a"
            t.append(f"| {r['target']} | {r['concurrency']} | {r['rps']:,.0f} | {vs} | "
                     f"{us(r['p50_ms'])} | {us(r['p99_ms'])} | {cpu(r)} | {cpu_vs} | {cmds_np(r)} |")
        md += ["## The hyper-auth-proxy shape (medians)", "",
               "tessera-compat: `session.format = \"hyper-auth-proxy\"`, "
               "`token.sources = [\"cookie-b64:Authorization\", \"bearer\"]`, "
               "`credentials.allow_plaintext_legacy = true`, on Redis holding "
               f"{env.get('SESSIONS', '1000')} plaintext-legacy records; every target's requests "
               "rotate over the sessions' base64 cookies (bench/compat.lua), wrk -t 1.", ""] + t + [""]
        summary += ["", "hyper-auth-proxy shape:"] + t

    P = {r["target"]: r for r in out["pinned"]}
    if out["pinned"]:
        t = ["| target | req/s | p50 | p99 | req/s vs nginx-proxy | p50 added (minus direct) | "
             "CPU of the target process per request | per rep (req/s, p50) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in out["pinned"]:
            vs = f"{r['rps'] / P['nginx-proxy']['rps']:.2f}x" if "nginx-proxy" in P else "n/a"
            added = "" if r["target"] == "direct" or "direct" not in P else \
                f"{(r['p50_ms'] - P['direct']['p50_ms']) * 1e3:+.0f} µs"
            reps = "; ".join(f"{x['rps']:,.0f}, {us(x['p50_ms'])}" for x in r["reps"])
            t.append(f"| {r['target']} | {r['rps']:,.0f} | {us(r['p50_ms'])} | {us(r['p99_ms'])} | "
                     f"{vs} | {added} | {cpu(r)} | {reps} |")
        md += ["## c=1 pinned (medians)", "",
               f"The matrix's targets at c=1 again, every process pinned with `taskset` "
               f"({env.get('PINNED_C1', '')}: wrk, the nginx origin, and the proxy under test with "
               "all its threads; Redis unpinned), so every run has the same layout. Unpinned, a c=1 "
               "run lands in one of two latency modes for nginx-proxy and tessera alike, depending "
               "on where the scheduler puts the three processes.", ""] + t + [""]
        summary += ["", "c=1 pinned:"] + t

    S = {(r["target"], r["concurrency"]): r for r in out["scaled"]}
    if out["scaled"]:
        t = ["| target | c | req/s | p50 | p99 | tessera-redis / this target (req/s) | "
             "CPU per request (every worker of the target) | Redis cmds/req (without PING) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in out["scaled"]:
            base = S.get(("tessera-redis", r["concurrency"]))
            vs = "" if r["target"] == "tessera-redis" or not base else \
                f"{base['rps'] / r['rps']:.2f}x"
            t.append(f"| {r['target']} | {r['concurrency']} | {r['rps']:,.0f} | {us(r['p50_ms'])} | "
                     f"{us(r['p99_ms'])} | {vs} | {cpu(r)} | {cmds_np(r)} |")
        md += ["## Peers with one worker per CPU (medians)", "",
               f"The matrix runs nginx-proxy and python-ref with one worker each; tessera serves "
               f"with one thread per CPU by default. Here both peers also run with one worker per "
               f"CPU ({env.get('NPROC')}): `nginx-proxy-mw` (the same proxy, `worker_processes "
               f"{env.get('NPROC')}`) and `python-ref-mw` (proxy.py `--workers {env.get('NPROC')}`, "
               "forked processes sharing the port), in the same round-robin as their one-worker "
               "runs and tessera-redis. CPU per request sums every worker's.", ""] + t + [""]
        summary += ["", "peers with one worker per CPU:"] + t

    if out["algs"]:
        A = {(r["alg"], r["mode"]): r for r in out["algs"]}
        t = ["| token | cache | req/s | p50 | p99 | vs HS512 (same cache state) | "
             "Redis cmds/req (all / without PING) | tessera CPU per request |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in out["algs"]:
            base = A.get(("HS512", r["mode"]))
            rel = f"{r['rps'] / base['rps']:.2f}x" if base else "n/a"
            t.append(f"| {r['alg']} | {r['mode']} | {r['rps']:,.0f} | {us(r['p50_ms'])} | "
                     f"{us(r['p99_ms'])} | {rel} | {cmds(r)} / {cmds_np(r)} | {cpu(r)} |")
        md += ["## Token algorithms and cold vs warm (tessera on Redis, c=8, medians)", ""] + t + [""]
        cw = []
        for name in ("HS512", "RS256", "EdDSA"):
            if (name, "warm") in A and (name, "cold") in A:
                w, c_ = A[(name, "warm")], A[(name, "cold")]
                cw.append(f"- {name}: warm {w['rps']:,.0f} req/s vs cold {c_['rps']:,.0f} req/s "
                          f"(warm/cold {w['rps'] / c_['rps']:.2f}x); p50 {us(w['p50_ms'])} vs "
                          f"{us(c_['p50_ms'])}; Redis commands/request {cmds(w)} vs {cmds(c_)}")
        md += cw + [""]
        summary += [""] + t

    if out["close"]:
        t = ["| target | c | req/s | p50 | p99 | upstream conns opened (max of reps; per rep) | "
             "most open at once | upstream conns closed by reason; exchanges drained (all reps) | "
             "proxy CPU per request | non-2xx | socket errors |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
        for r in out["close"]:
            per_rep = ", ".join(str(n) for n in r.get("origin_accepted_per_rep", []))
            closed = closes_text(r["upstream_closed"]) if "upstream_closed" in r else "n/a"
            t.append(f"| {r['target']} | {r['concurrency']} | {r['rps']:,.0f} | {us(r['p50_ms'])} | "
                     f"{us(r['p99_ms'])} | {r['upstream_conns']} ({per_rep}) | "
                     f"{r.get('max_open_upstream', 'n/a')} | {closed} | "
                     f"{cpu(r)} | {r['non2xx']} | {r['socket_errors']} |")
        md += [f"## New client connection per request (`wrk -H \"Connection: close\"`, "
               f"tessera `upstream.max_connections = {env.get('POOL_CAP', '16')}`, medians)", ""] + t + [""]
        for r in out["close"]:
            if "upstream_closed_per_rep" in r:
                md += [f"tessera-pool16 at c={r['concurrency']}, per repetition (from before the run "
                       "to 0.5 s after it): " + " · ".join(
                           f"rep {p['rep']}: {closes_text(p)}" for p in r["upstream_closed_per_rep"]),
                       ""]
        if out.get("close_section_closed"):
            md += ["tessera-pool16 over the whole section (its first fill and the time between runs "
                   "included; `[metrics]` on, so it also counts each request by status and "
                   "duration): upstream connections closed: "
                   f"{closes_text(out['close_section_closed'])}.", ""]
        summary += [""] + t

    rev = out["revocation"]
    if rev:
        md += ["## Revocation latency (two tessera instances on one Redis, DEL in Redis)", "",
               f"{rev['trials']} trials, {rev['completed']} saw the 401, {rev['timeouts']} timeouts, "
               f"{rev['errors']} errors: p50 **{rev['p50_ms']} ms**, p99 **{rev['p99_ms']} ms**, "
               f"max {rev['max_ms']} ms (min {rev['min_ms']}, mean {rev['mean_ms']}); one poll round "
               f"trip on B: {rev['poll_ms_mean']} ms (the resolution); the DEL call itself: "
               f"{rev['revoke_call_p50_ms']} ms p50.", ""]
        summary += ["", f"revocation: p50 {rev['p50_ms']} ms, p99 {rev['p99_ms']} ms, max {rev['max_ms']} ms"]

    if out["affinity"]:
        def opened(r):
            return f"{r['upstream_conns']} ({', '.join(map(str, r['origin_accepted_per_rep']))})"

        def times(v):
            return "n/a" if v is None else f"{v:.2f}x"
        def waited(r):
            if "handovers" not in r:
                return ""
            return f"{r['handovers']:,} / {r['waits_expired']:,}"
        t = ["| affinity | sessions (users) | c | req/s | p50 | p99 | upstream conns opened "
             "(max; per rep) | opened per 1,000 requests | own-connection waits: handed over / "
             "expired (all reps) | tessera CPU per request | non-2xx | socket errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in out["affinity"]:
            t.append(f"| {r['affinity']} | {r['sessions']:,} | {r['concurrency']} | {r['rps']:,.0f} | "
                     f"{us(r['p50_ms'])} | {us(r['p99_ms'])} | {opened(r)} | "
                     f"{r['upstream_conns_per_1k_req']} | {waited(r)} | {cpu(r)} | {r['non2xx']} | "
                     f"{r['socket_errors']} |")
        rt = ["| sessions (users) | c | req/s | p50 | p99 | tessera CPU per request | "
              "upstream conns opened (session vs none) |", "|---:|---:|---:|---:|---:|---:|---:|"]
        nones = {(r["sessions"], r["concurrency"]): r for r in out["affinity"]
                 if r["affinity"] == "none"}
        for r in out["affinity"]:
            v = r.get("vs_none")
            if not v:
                continue
            b = nones[(r["sessions"], r["concurrency"])]
            rt.append(f"| {r['sessions']:,} | {r['concurrency']} | {times(v['rps'])} | {times(v['p50_ms'])} | "
                      f"{times(v['p99_ms'])} | {times(v['cpu_us_per_req'])} | "
                      f"{r['upstream_conns']} vs {b['upstream_conns']} |")
        sets = " and ".join(f"{n:,} sessions" for n in
                            sorted({r["sessions"] for r in out["affinity"]}, reverse=True))
        md += ["## Upstream affinity cost (`[upstream] affinity = \"session\"` vs `\"none\"`, "
               "tessera on Redis, medians)", "",
               "tessera-redis (`affinity = \"none\"`, the default) and tessera-affinity (the same "
               "config plus `affinity = \"session\"`), both with the default `max_connections = 64`. "
               "Two session sets from `tokens.py --distinct-users` (session n = user alice-n, so each "
               "session injects its own `Authorization: Basic`; checked by opening every sealed "
               f"credential): {sets} "
               "(more users than pool slots: with affinity almost every request finds no idle "
               "connection of its own user, closes another user's and opens one; fewer users than "
               "slots: each user keeps its own connections). The wrk script rotates over the set, one "
               "session per request. Every token went once through both instances, then 1 s of wrk "
               "per (instance, set), before the measured runs. Upstream connections opened: origin "
               "`accepted` delta per run (the most of the repetitions; per rep in brackets). "
               "Own-connection waits (affinity at the cap, a user holding its share waits up to "
               "5 ms for one of its own connections): tessera-affinity's "
               "`tessera_upstream_affinity_handovers_total` and `..._waits_expired_total` deltas, "
               "summed over the reps (tessera-affinity alone has `[metrics]` on for these, so it also "
               "counts each request by status and duration).", ""] + t + [""]
        md += ["### affinity \"session\" / \"none\" (same sessions and c)", ""] + rt + [""]
        summary += [""] + t + [""] + rt

    mem = out["memory"]
    if mem:
        def mib(k):
            return f"{k / 1024:.1f} MiB"
        md += [f"## Memory with {mem['sessions']:,} sessions (tessera on Redis)", "",
               f"`[session] cache_max_entries = {mem.get('session_cache_max_entries', '?')}`, "
               f"`cache_ttl_seconds = 3600`, `[token] cache_max_entries = "
               f"{mem.get('token_cache_max_entries', '?')}`.", "",
               "| moment | VmRSS | VmHWM | requests | Redis GETs |", "|---|---:|---:|---:|---:|",
               f"| after start | {mib(mem['start']['vmrss_kib'])} | {mib(mem['start']['vmhwm_kib'])} | | |",
               f"| after pass 1 (each session once, {mem['after_pass1']['seconds']} s) | "
               f"{mib(mem['after_pass1']['vmrss_kib'])} | {mib(mem['after_pass1']['vmhwm_kib'])} | "
               f"{mem['after_pass1']['requests']:,} | {mem['after_pass1']['redis_gets']:,} |",
               f"| after pass 2 (all again, {mem['after_pass2']['seconds']} s) | "
               f"{mib(mem['after_pass2']['vmrss_kib'])} | {mib(mem['after_pass2']['vmhwm_kib'])} | "
               f"{mem['after_pass2']['requests']:,} | {mem['after_pass2']['redis_gets']:,} |", "",
               f"Sessions made by tokens.py in {mem['create_s']} s; Redis used_memory afterwards "
               f"{mem['redis_used_memory_bytes'] / 1048576:.1f} MiB.", ""]
        summary += ["", f"memory: VmRSS {mib(mem['after_pass1']['vmrss_kib'])} after pass 1, "
                    f"VmHWM {mib(mem['after_pass2']['vmhwm_kib'])}; pass-2 Redis GETs "
                    f"{mem['after_pass2']['redis_gets']}"]
    if procmem:
        md += ["Process memory at the end of their sections (VmRSS / VmHWM): " + "; ".join(
            f"{k} {v['vmrss_kib'] / 1024:.1f} / {v['vmhwm_kib'] / 1024:.1f} MiB"
            for k, v in procmem.items()) + ".", ""]

    # ------------------------------------------------------------ targets
    goals = []

    def goal(name, ok, measured):
        goals.append(f"| {name} | {'met' if ok else '**missed**'} | {measured} |")

    if ("nginx-proxy", 1) in M:
        for t_ in TESSERAS:
            parts, ok = [], True
            for c in concs:
                if (t_, c) in M and ("nginx-proxy", c) in M:
                    x = M[(t_, c)]["rps"] / M[("nginx-proxy", c)]["rps"]
                    ok &= x >= 1.0
                    parts.append(f"c={c} {x:.2f}x ({(x - 1) * 100:+.0f}%)")
            goal(f"{t_} >= 1.0x nginx-proxy req/s", ok, "; ".join(parts))
        for t_ in TESSERAS:
            if (t_, 1) in M and ("direct", 1) in M:
                d = (M[(t_, 1)]["p50_ms"] - M[("direct", 1)]["p50_ms"]) * 1e3
                goal(f"{t_} <= 15 µs added p50 at c=1 (minus direct)", d <= 15,
                     f"{d:+.0f} µs ({'within' if d <= 15 else 'over'} by {abs(15 - d):.0f} µs)")
        for t_ in TESSERAS:
            if t_ in P and "nginx-proxy" in P and "direct" in P:
                x = P[t_]["rps"] / P["nginx-proxy"]["rps"]
                d = (P[t_]["p50_ms"] - P["direct"]["p50_ms"]) * 1e3
                goal(f"{t_}, c=1 pinned: >= 1.0x nginx-proxy req/s; <= 15 µs added p50",
                     x >= 1.0 and d <= 15, f"{x:.2f}x ({(x - 1) * 100:+.0f}%); {d:+.0f} µs")
        for t_ in TESSERAS:
            if (t_, 8) in M and ("python-ref", 8) in M:
                x = M[(t_, 8)]["rps"] / M[("python-ref", 8)]["rps"]
                goal(f"{t_} >= 30x python-ref req/s at c=8", x >= 30,
                     f"{x:.1f}x ({'above' if x >= 30 else 'short'} by {abs(x - 30):.1f}x)")
    for peer, x_goal, what in (("nginx-proxy-mw", 1.0, "nginx-proxy"), ("python-ref-mw", 30, "python-ref")):
        parts, ok = [], True
        for c in sorted({c for (t_, c) in S if t_ == peer}):
            if ("tessera-redis", c) in S and (what == "nginx-proxy" or c == 8):
                x = S[("tessera-redis", c)]["rps"] / S[(peer, c)]["rps"]
                ok &= x >= x_goal
                parts.append(f"c={c} {x:.2f}x (one-worker {what}: "
                             f"{S[('tessera-redis', c)]['rps'] / S[(what, c)]['rps']:.2f}x)"
                             if (what, c) in S else f"c={c} {x:.2f}x")
        if parts:
            goal(f"tessera-redis >= {x_goal:g}x {peer} req/s ({what} with one worker per CPU"
                 f"{'' if what == 'nginx-proxy' else ', c=8'}; same run)", ok, "; ".join(parts))
    cpu_goals = [(M, t_) for t_ in TESSERAS] + [(C, "tessera-compat")]
    for rows, t_ in cpu_goals:
        parts, ok = [], True
        for c in (8, 64):
            if (t_, c) in rows and ("nginx-proxy", c) in rows:
                a, b = rows[(t_, c)]["cpu_us_per_req"], rows[("nginx-proxy", c)]["cpu_us_per_req"]
                if a and b:
                    ok &= a / b <= 1.0
                    parts.append(f"c={c} {a / b:.2f}x ({a:.0f} vs {b:.0f} µs)")
        if parts:
            goal(f"{t_} CPU per request <= 1.0x nginx-proxy's (c=8, 64; issue 39)", ok,
                 "; ".join(parts))
    if out["compat"]:
        parts, ok = [], True
        for c in sorted({c for (_, c) in C}):
            if ("tessera-compat", c) in C and ("nginx-proxy", c) in C:
                x = C[("tessera-compat", c)]["rps"] / C[("nginx-proxy", c)]["rps"]
                ok &= x >= 1.0
                parts.append(f"c={c} {x:.2f}x")
        goal("tessera-compat >= 1.0x nginx-proxy req/s (issue 39)", ok, "; ".join(parts))
        if all(k in C for k in (("tessera-compat", 1), ("nginx-proxy", 1), ("direct", 1))):
            d = (C[("tessera-compat", 1)]["p50_ms"] - C[("direct", 1)]["p50_ms"]) * 1e3
            n = (C[("nginx-proxy", 1)]["p50_ms"] - C[("direct", 1)]["p50_ms"]) * 1e3
            goal("tessera-compat added p50 at c=1 <= nginx-proxy's (issue 39)", d <= n,
                 f"{d:+.0f} µs vs {n:+.0f} µs")
        parts, ok = [], True
        for c in sorted({c for (_, c) in C}):
            if ("tessera-compat", c) in C:
                r = C[("tessera-compat", c)]
                ok &= r["redis_cmds_per_req_excl_ping"] == 0
                parts.append(f"c={c}: {cmds_np(r)}")
        goal("0 Redis commands per warm request (tessera-compat)", ok, "; ".join(parts))
    if out["matrix"]:
        parts, ok = [], True
        for c in concs:
            if ("tessera-redis", c) in M:
                r = M[("tessera-redis", c)]
                ok &= r["redis_cmds_per_req_excl_ping"] == 0
                parts.append(f"c={c}: {cmds_np(r)} per request over {r['requests']:,} requests "
                             f"(all commands: {breakdown(r)})")
        goal("0 Redis commands per warm request (tessera-redis; the 1/s PING heartbeat of the "
             "invalidation connection counted apart)", ok, "; ".join(parts))
    if out["close"]:
        cap = int(env.get("POOL_CAP", "16"))
        parts, ok = [], True
        for r in out["close"]:
            if r["instance"] == "tessera-pool16":
                # The cap bounds connections open at once; more may be opened over a run as
                # others close.
                ok &= (r.get("max_open_upstream") or 0) <= cap
                parts.append(f"c={r['concurrency']}: at most {r.get('max_open_upstream')} open "
                             f"(cap {cap}; {r['upstream_conns']} opened over the run)")
        goal("upstream connections open at once <= pool cap (Connection: close clients)", ok,
             "; ".join(parts))
    if out["algs"]:
        A = {(r["alg"], r["mode"]): r for r in out["algs"]}
        if ("HS512", "warm") in A:
            parts, ok = [], True
            for name in ("RS256", "EdDSA"):
                if (name, "warm") in A:
                    x = A[(name, "warm")]["rps"] / A[("HS512", "warm")]["rps"]
                    ok &= x >= 0.9
                    parts.append(f"{name} {x:.2f}x")
            cold = [f"{n} {A[(n, 'cold')]['rps'] / A[('HS512', 'cold')]['rps']:.2f}x"
                    for n in ("RS256", "EdDSA") if (n, "cold") in A and ("HS512", "cold") in A]
            goal("RS256/EdDSA >= 0.9x HS512 req/s (warm, c=8)", ok,
                 "warm: " + ", ".join(parts) + ("; cold (no caches, for information): "
                                                + ", ".join(cold) if cold else ""))
    if rev:
        goal("revocation p99 <= 10 ms", rev["p99_ms"] is not None and rev["p99_ms"] <= 10,
             f"p99 {rev['p99_ms']} ms (p50 {rev['p50_ms']}, max {rev['max_ms']}; "
             f"{rev['completed']}/{rev['trials']} trials)")
    if mem:
        rss = mem["after_pass1"]["vmrss_kib"] / 1024
        hwm = mem["after_pass2"]["vmhwm_kib"] / 1024
        goal(f"RSS <= 64 MiB with {mem['sessions']:,} sessions cached", rss <= 64,
             f"VmRSS {rss:.1f} MiB ({'under' if rss <= 64 else 'over'} by {abs(64 - rss):.1f} MiB); "
             f"VmHWM {hwm:.1f} MiB; pass-2 Redis GETs {mem['after_pass2']['redis_gets']}")
    if goals:
        gt = ["| target | status | measured |", "|---|---|---|"] + goals
        md = ["## Targets (issue 4)", ""] + gt + [""] + md
        summary += [""] + gt

    binary = env.get("BIN") or "target/release/tessera"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if binary.startswith(root + os.sep):
        binary = os.path.relpath(binary, root)
    stale = (f"\n**Warning:** files under src/ or Cargo.* were newer than {binary} "
             "at run time; the numbers are for the binary as built.\n") if env.get("STALE") else ""
    stamp = os.path.splitext(os.path.basename(args.json))[0]
    plots = [f"{stamp}-{s}-{k}.svg" for s in ("matrix", "scaled", "algs", "close", "affinity") if out[s]
             for k in ("rps", "latency")]
    head = f"""# Benchmark suite (issue 4): tessera vs nginx and the Python reference, loopback

- when: {env.get('WHEN')} (run took {int(env.get('ELAPSED', 0)) // 60} min {int(env.get('ELAPSED', 0)) % 60} s; sections: {env.get('SECTION_TIMES', '').strip()} seconds)
- command: `{env.get('BENCH_CMD')}`
- commit at start: {env.get('COMMIT')}; binary: {binary} ({env.get('TESSERA_V')}, built {env.get('BIN_BUILT')}, sha256 {env.get('BIN_SHA256')}…)
- machine: nproc {env.get('NPROC')}, {env.get('CPU') or 'cpu model unknown'}, {env.get('MEM_TOTAL')} RAM, kernel {env.get('KERNEL')}, {env.get('IDLE')}
- load average (1/5/15 min): {env.get('LOAD_START')} before, {env.get('LOAD_END')} after
- {env.get('NGINX_V') and 'nginx ' + env.get('NGINX_V')}, {env.get('WRK_V')}, {env.get('REDIS_V')}, {env.get('PY_V')}
{stale}
wrk, both nginx processes, redis-server, the Python reference and every tessera share the same
{env.get('NPROC')} cores: absolute numbers are capped by the load generator competing for CPU;
compare within this run.

Setup: origin = nginx (`worker_processes 1`, `access_log off`, `keepalive_requests 1000000`)
serving a static 1 KiB JSON at /1k, plus stub_status on another port of the same process;
`nginx-proxy` = a second nginx process, plain reverse proxy to the origin (`keepalive 64`,
HTTP/1.1, no auth); `python-ref` = bench/reference/proxy.py, 1 worker, on Redis; `tessera-redis`
/ `tessera-embedded` = `tessera serve` on Redis / the embedded store, default caches and pool
but `[session] cache_ttl_seconds = 3600` (the default 300 s, counted from a session's read, would
have a run longer than 5 minutes read every session again: one GET per session per 300 s),
`level = "warn"`, `access_log = false`; `tessera-busy` = tessera-redis plus `[server] busy_poll_us =
{env.get('BUSY_POLL_US')}` (a serving thread polls its sockets up to {env.get('BUSY_POLL_US')} µs before it sleeps: less
wake-up latency, more CPU). Every request carries `Authorization: Bearer` rotating over
{env.get('SESSIONS')} sessions (bench/tokens.py for Redis; {env.get('EMBEDDED_SESSIONS')} runs of
`tessera session create` for the embedded store, {env.get('EMB_CREATE_S') or '?'} s), the same wrk
Lua script for every target. `wrk -t (1 if c<2 else 2) -c c -d {env.get('DURATION')} --latency`,
{env.get('REPS')} repetitions round-robin over the targets; medians. A 2 s warm-up per target ran
first, then every token once through each tessera (bench/suite.sh's Python keep-alive loop), so
caches start warm. Redis commands/request: INFO commandstats delta (INFO excluded) over all
repetitions / requests, shown with and without PING (each tessera on Redis sends one PING a second
on its invalidation connection, whatever the traffic). CPU per request: user + system time of the
target's own process (tessera, proxy.py, the nginx worker) during the run / requests.
Upstream connections opened: the origin's stub_status `accepted` delta (minus the status
request's own), the most over the repetitions.

Plots: {', '.join(f'[{p}]({p})' for p in plots) or 'none'}.
"""
    detail = ["## Every run", "", "| section | target | c | rep | req/s | p50 | p99 | requests | "
              "Redis cmds | origin accepted | max open | target CPU s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in runs:
        detail.append(f"| {r['section']} | {r['target']} | {r['c']} | {r['rep']} | {r['rps']:,.0f} | "
                      f"{us(r['p50_us'] / 1e3)} | {us(r['p99_us'] / 1e3)} | {r['requests']:,} | "
                      f"{', '.join(f'{k} {v}' for k, v in r['redis'].items()) or '0'} | "
                      f"{r['origin_accepted']} | {'' if r['max_open'] is None else r['max_open']} | "
                      f"{'' if r['cpu_s'] is None else format(r['cpu_s'], '.2f')} |")
    tail = ["", f"Non-empty log lines: {env.get('LOGS', '').strip()}.",
            f"Raw wrk output: `{args.raw_name}`." if args.raw_name else ""]
    with open(args.md, "w") as f:
        f.write(head + "\n" + "\n".join(md) + "\n" + "\n".join(detail) + "\n" + "\n".join(tail) + "\n")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
