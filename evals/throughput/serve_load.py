"""Load test of ``tokenrouter serve`` on the packaged pair, over loopback only.

Starts ``tokenrouter serve`` as a subprocess on 127.0.0.1 (a free port), then in one run:

1. HTTP: ``--clients`` concurrent streaming clients send ``--requests`` completions (GSM8K
   prompts shipped with the package, as token ids, ``ignore_eos`` so every full output has
   ``--max-tokens`` tokens); ``--disconnect`` of them hang up at a random token. A poller checks
   ``/health`` every 0.5 s meanwhile.
2. In-process: the same workload (same prompts, same requests hanging up at the same token)
   through ``router.astream`` on a `Router` in this process with the same policy, ``--clients``
   at a time. Phases alternate for ``--rounds`` rounds; throughput is compared round by round.
3. Memory: ``--rss-requests`` more short requests (``--rss-max-tokens`` tokens, same
   disconnect mix) over HTTP; the server process's RSS is read after the first
   ``--rss-first`` of them and at the end.

Bars checked and printed: every request that was not hung up completes with its full output;
zero 5xx; /health always 200; after each HTTP phase every KV pool is back to its initial free
blocks and the server holds no request; committed-token throughput over HTTP >= 90% of
in-process (median of the per-round ratios); server RSS at the end within 5% of RSS after
``--rss-first`` requests. Results go to ``--out`` (JSON).

Bounded: a fixed number of requests per phase, each with a timeout, and ``--time-limit``
seconds for the whole run (no new request starts after it).

Run:
    .venv/bin/python evals/throughput/serve_load.py                         # the full run
    .venv/bin/python evals/throughput/serve_load.py --requests 64 --rounds 1 --rss-requests 0   # a quick one

Writes ``<out>/serve_load.json`` (every bar, the per-phase numbers, the RSS readings).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


@dataclass
class Job:
    """One request of the workload: its prompt (token ids) and where it hangs up (None: never;
    k: after k committed tokens)."""

    index: int
    prompt: list[int]
    cut: int | None


@dataclass
class Phase:
    name: str
    requests: int = 0
    sent: int = 0
    completed_full: int = 0
    expected_full: int = 0
    disconnected: int = 0
    status_5xx: int = 0
    status_other: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    wall_s: float = 0.0
    committed_tokens: int = 0
    tok_s: float = 0.0
    ttft_p50_s: float = 0.0
    latency_p50_s: float = 0.0
    texts: dict = field(default_factory=dict)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("texts")
        d["errors"] = d["errors"][:5]
        return d


def workload(tokenizer_router, n: int, disconnect: float, max_tokens: int, seed: int) -> list[Job]:
    from tokenrouter_sdk.benchmarks import load_prompts

    base = load_prompts("gsm8k", min(n, 128))
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        ids = tokenizer_router.encode(base[i % len(base)])
        cut = rng.randrange(0, max_tokens) if rng.random() < disconnect else None
        jobs.append(Job(i, ids, cut))
    return jobs


# -- server process ------------------------------------------------------------------------------
def start_server(policy: str, log: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, TQDM_DISABLE="1")
    fh = open(log, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenrouter_sdk.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--policy",
            policy,
            "--log-level",
            "warning",
        ],
        stdout=fh,
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        m = re.search(r"tokenrouter serve: (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start within 600 s")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children_rss_mb(pid: int) -> float:
    total = 0.0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    total += rss_mb(int(p.name))
            except (OSError, ValueError, IndexError):
                continue
    return total


async def scrape(client: httpx.AsyncClient) -> dict:
    text = (await client.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def committed(metrics: dict) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("tokenrouter_committed_tokens_total"))


# -- HTTP phase ----------------------------------------------------------------------------------
async def http_phase(
    url: str, jobs: list[Job], clients: int, max_tokens: int, deadline: float, name: str, keep_text: bool = True
) -> tuple[Phase, list]:
    ph = Phase(name, requests=len(jobs))
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    health_bad: list = []
    ttfts, lats = [], []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        before = await scrape(client)
        stop = asyncio.Event()

        async def health():
            while not stop.is_set():
                try:
                    r = await client.get("/health", timeout=30)
                    if r.status_code != 200:
                        health_bad.append((time.time(), r.status_code, r.text[:200]))
                except httpx.HTTPError as e:
                    health_bad.append((time.time(), type(e).__name__, str(e)))
                await asyncio.sleep(0.5)

        async def one(job: Job):
            body = {
                "model": "tokenrouter",
                "prompt": job.prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            t0 = time.perf_counter()
            got, text, final = 0, [], None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code >= 500:
                    ph.status_5xx += 1
                    ph.errors.append((job.index, r.status_code, (await r.aread())[:300].decode(errors="replace")))
                    return
                if r.status_code != 200:
                    ph.status_other[r.status_code] = ph.status_other.get(r.status_code, 0) + 1
                    ph.errors.append((job.index, r.status_code, (await r.aread())[:300].decode(errors="replace")))
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        ph.errors.append((job.index, "stream error", ev["error"]["message"][:300]))
                        return
                    if got == 0:
                        ttfts.append(time.perf_counter() - t0)
                    ch = ev["choices"][0]
                    text.append(ch["text"])
                    if ch["finish_reason"] is not None:
                        final = ev
                    else:
                        got += len(ev["tokenrouter"]["writers"])
                    if job.cut is not None and got >= job.cut:
                        ph.disconnected += 1
                        return  # leaving the block closes the connection mid-stream
            lats.append(time.perf_counter() - t0)
            if job.cut is None:
                ok = (
                    final is not None
                    and final["usage"]["completion_tokens"] == max_tokens
                    and final["choices"][0]["finish_reason"] == "length"
                    and len(final["tokenrouter"]["writers"]) == max_tokens
                )
                ph.completed_full += ok
                if not ok:
                    ph.errors.append((job.index, "incomplete", json.dumps(final)[:300]))
                if keep_text:
                    ph.texts[job.index] = "".join(text)
            else:  # finished before its cut point (a short answer): counts as complete, not as cut
                ph.completed_full += 1
                ph.expected_full += 1

        async def worker():
            while not queue.empty() and time.monotonic() < deadline:
                job = queue.get_nowait()
                ph.sent += 1
                ph.expected_full += job.cut is None
                try:
                    await one(job)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                    ph.errors.append((job.index, type(e).__name__, str(e)[:300]))

        poller = asyncio.create_task(health())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        ph.wall_s = time.perf_counter() - t0
        stop.set()
        await poller
        after = await scrape(client)
        ph.committed_tokens = int(committed(after) - committed(before))
        ph.tok_s = ph.committed_tokens / ph.wall_s if ph.wall_s else 0.0
    ph.ttft_p50_s = statistics.median(ttfts) if ttfts else 0.0
    ph.latency_p50_s = statistics.median(lats) if lats else 0.0
    return ph, health_bad


async def settled(url: str, timeout: float = 60.0) -> dict:
    """The server's pools and request counts once it is idle (or after ``timeout``)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        deadline = time.monotonic() + timeout
        while True:
            h = (await client.get("/health")).json()
            m = await scrape(client)
            free = all(
                x.get("free_blocks", -1) == x.get("num_blocks") and x.get("owned") == x.get("pending") == 0
                for x in h["models"].values()
            )
            idle = m.get("tokenrouter_requests_in_flight", -1) == 0 and m.get("tokenrouter_requests_waiting", -1) == 0
            if (free and idle) or time.monotonic() > deadline:
                return {
                    "pools_free": free,
                    "no_request_held": idle,
                    "health": h["models"],
                    "in_flight": m.get("tokenrouter_requests_in_flight"),
                    "waiting": m.get("tokenrouter_requests_waiting"),
                }
            await asyncio.sleep(0.2)


# -- in-process phase ----------------------------------------------------------------------------
async def local_phase(router, jobs: list[Job], clients: int, max_tokens: int, deadline: float, name: str) -> Phase:
    ph = Phase(name, requests=len(jobs))
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    count = [0]

    def observe(ev):
        if type(ev).__name__ == "Committed":
            count[0] += len(ev.tokens)

    remove = router.engine.add_observer(observe)
    ttfts, lats = [], []

    async def one(job: Job):
        t0 = time.perf_counter()
        got, text = 0, []
        stream = router.astream(job.prompt, max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        try:
            async for ev in stream:
                if got == 0 and ev.token_id is not None:
                    ttfts.append(time.perf_counter() - t0)
                got += ev.token_id is not None
                text.append(ev.text)
                if job.cut is not None and got >= job.cut and got < max_tokens:
                    ph.disconnected += 1
                    return
        finally:
            await stream.aclose()
        lats.append(time.perf_counter() - t0)
        ph.completed_full += got == max_tokens
        if job.cut is not None:
            ph.expected_full += 1
        ph.texts[job.index] = "".join(text)

    async def worker():
        while not queue.empty() and time.monotonic() < deadline:
            job = queue.get_nowait()
            ph.sent += 1
            ph.expected_full += job.cut is None
            await one(job)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    ph.wall_s = time.perf_counter() - t0
    remove()
    ph.committed_tokens = count[0]
    ph.tok_s = ph.committed_tokens / ph.wall_s if ph.wall_s else 0.0
    ph.ttft_p50_s = statistics.median(ttfts) if ttfts else 0.0
    ph.latency_p50_s = statistics.median(lats) if lats else 0.0
    return ph


# -- main ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    p.add_argument("--requests", type=int, default=256, help="requests per throughput phase (default 256)")
    p.add_argument("--disconnect", type=float, default=0.1, help="share of requests that hang up (default 0.1)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request in the throughput phases")
    p.add_argument("--rounds", type=int, default=2, help="HTTP / in-process rounds (default 2)")
    p.add_argument("--policy", default="rstitch:tau=0.1", help="policy of the server and the in-process Router")
    p.add_argument("--rss-requests", type=int, default=2000, help="requests of the memory phase (0: skip it)")
    p.add_argument("--rss-first", type=int, default=200, help="RSS is read after this many of them, then at the end")
    p.add_argument("--rss-max-tokens", type=int, default=16, help="tokens per request in the memory phase")
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run (default 3600)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    # SIGTERM (kill, pkill, a CI timeout) ends the run through the `finally` below, which stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.policies.registry import build_policy

    out_path = evalkit.Output(args, __file__).path(".json")
    log = Path(tempfile.gettempdir()) / f"serve_load_server_{os.getpid()}.log"
    proc, url = start_server(args.policy, log)
    print(f"server {url} (pid {proc.pid}), policy {args.policy}", flush=True)
    router = Router.default(build_policy(args.policy))
    result: dict = {
        "server_log": str(log),
        "command": " ".join([sys.executable, *sys.argv]),
        "args": vars(args),
        "url": url,
        "rounds": [],
    }
    bars: dict = {}
    try:
        jobs = workload(router, args.requests, args.disconnect, args.max_tokens, args.seed)
        warm = [Job(-1 - i, jobs[i].prompt, None) for i in range(4)]
        asyncio.run(http_phase(url, warm, 4, 8, deadline, "warm-up", keep_text=False))
        asyncio.run(local_phase(router, warm, 4, 8, deadline, "warm-up"))
        health_bad_all, settled_all = [], []
        for rnd in range(args.rounds):
            loc = asyncio.run(local_phase(router, jobs, args.clients, args.max_tokens, deadline, f"in-process {rnd}"))
            http, health_bad = asyncio.run(
                http_phase(url, jobs, args.clients, args.max_tokens, deadline, f"http {rnd}")
            )
            st = asyncio.run(settled(url))
            same = sum(http.texts.get(i) == t for i, t in loc.texts.items() if i in http.texts)
            health_bad_all += health_bad
            settled_all.append(st)
            row = {
                "http": http.summary(),
                "in_process": loc.summary(),
                "ratio": http.tok_s / loc.tok_s if loc.tok_s else 0,
                "health_not_200": health_bad,
                "after": st,
                "same_text_as_in_process": f"{same}/{len(set(http.texts) & set(loc.texts))}",
            }
            result["rounds"].append(row)
            print(
                f"round {rnd}: http {http.tok_s:.1f} tok/s ({http.committed_tokens} tok, {http.wall_s:.1f} s, "
                f"{http.completed_full}/{http.expected_full} full, {http.disconnected} cut, {http.status_5xx} 5xx, "
                f"{len(http.errors)} errors) | in-process {loc.tok_s:.1f} tok/s ({loc.committed_tokens} tok, "
                f"{loc.wall_s:.1f} s) | ratio {row['ratio']:.3f} | same text {row['same_text_as_in_process']} | "
                f"health bad {len(health_bad)} | pools free {st['pools_free']} idle {st['no_request_held']}",
                flush=True,
            )
        ratios = [r["ratio"] for r in result["rounds"]]
        bars["every_full_request_complete"] = all(
            r["http"]["completed_full"] == r["http"]["expected_full"] for r in result["rounds"]
        )
        bars["zero_5xx"] = all(r["http"]["status_5xx"] == 0 for r in result["rounds"])
        bars["health_always_200"] = not health_bad_all
        bars["pools_free_and_idle_after"] = all(s["pools_free"] and s["no_request_held"] for s in settled_all)
        bars["throughput_ratio_median"] = statistics.median(ratios) if ratios else 0.0
        bars["throughput_ratio_ok"] = bars["throughput_ratio_median"] >= 0.9

        if args.rss_requests and time.monotonic() < deadline:
            rjobs = workload(router, args.rss_requests, args.disconnect, args.rss_max_tokens, args.seed + 1)
            first, rest = rjobs[: args.rss_first], rjobs[args.rss_first :]
            p1, hb1 = asyncio.run(
                http_phase(url, first, args.clients, args.rss_max_tokens, deadline, "rss first", keep_text=False)
            )
            asyncio.run(settled(url))
            rss_first = rss_mb(proc.pid)
            p2, hb2 = asyncio.run(
                http_phase(url, rest, args.clients, args.rss_max_tokens, deadline, "rss rest", keep_text=False)
            )
            st = asyncio.run(settled(url))
            rss_end = rss_mb(proc.pid)
            done = p1.sent + p2.sent
            result["rss"] = {
                "after_first_mb": rss_first,
                "after_all_mb": rss_end,
                "requests": done,
                "growth": rss_end / rss_first - 1,
                "children_mb": children_rss_mb(proc.pid),
                "first": p1.summary(),
                "rest": p2.summary(),
                "health_not_200": hb1 + hb2,
                "after": st,
            }
            bars["rss_growth"] = rss_end / rss_first - 1
            bars["rss_within_5pct"] = abs(bars["rss_growth"]) <= 0.05
            bars["rss_phase_5xx"] = p1.status_5xx + p2.status_5xx
            bars["rss_phase_full"] = f"{p1.completed_full + p2.completed_full}/{p1.expected_full + p2.expected_full}"
            print(
                f"rss: {rss_first:.1f} MB after {p1.sent} requests, {rss_end:.1f} MB after "
                f"{done} ({bars['rss_growth'] * 100:+.2f}%); sub-servers {result['rss']['children_mb']:.0f} MB;"
                f" 5xx {bars['rss_phase_5xx']}, full {bars['rss_phase_full']}, pools free {st['pools_free']}",
                flush=True,
            )
    finally:
        router.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    result["bars"] = bars
    out_path.write_text(json.dumps(result, indent=1, default=str))
    print("bars:", json.dumps(bars, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
