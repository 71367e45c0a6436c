"""``prefixcache serve`` as the operator runs it: a subprocess with ``--api-keys``, ``--disk-cache``
and ``--redis``, the embedded model, the official OpenAI client. A restart is warm from disk and
answers the same; one tenant hits across two processes through Redis while another does not;
SIGTERM stops a server cleanly (exit status 0, no process left behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis

import prefixcache
from prefixcache.engine.model import default_dtype

from .conftest import free_port, stop_process_tree, wait_http

SRC = str(Path(prefixcache.__file__).resolve().parents[1])
KEYS = {"sk-alpha-0123456789abcdef": "alpha", "sk-beta-0123456789abcdef0": "beta"}
ALPHA, BETA = list(KEYS)
SYSTEM = (
    "You are the travel desk of a small mountain hotel. Answer in one short sentence. "
    "Breakfast is served from seven to ten, the sauna opens at four, and the cable car runs "
    "every twenty minutes until six in the evening. "
) * 4
#: A prompt none of the processes has seen before the Redis part (a block promoted from disk is
#: not written to Redis again, so a prompt sharing SYSTEM would find its head missing there).
OTHER_SYSTEM = SYSTEM.replace("mountain hotel", "lakeside inn")


@dataclass(slots=True)
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> None:
        """SIGTERM; the server must exit 0 and leave no process of its own behind."""
        children = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        alive = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert (code, alive) == (0, []), self.log.read_text()[-3000:]


def serve(tmp: Path, name: str, *flags: str) -> Served:
    port = free_port()
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    env = {
        **os.environ,
        "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PREFIXCACHE_SALT_SECRET": "one-deployment-shares-this-salt-secret",
        "OMP_NUM_THREADS": "1",
    }
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--port", str(port), "--api-keys", str(keys)]
    cmd += ["--threads", "1", "--log-level", "warning", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Served(proc, f"http://127.0.0.1:{port}", log)


def wait_up(*servers: Served) -> None:
    for s in servers:
        try:
            wait_http(s.url + "/health", timeout_s=300)
        except RuntimeError:
            raise AssertionError(s.log.read_text()[-3000:]) from None


def ask(server: Served, key: str, question: str, system: str = SYSTEM) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of a greedy chat completion."""
    r = server.client(key).chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return (
        r.choices[0].message.content or "",
        r.usage.prompt_tokens,
        r.usage.prompt_tokens_details.cached_tokens,
    )


def tier_hits(server: Served, tier: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'prefixcache_tier_hits_total{{tier="{tier}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.model
@pytest.mark.redis
def test_serve_processes_restart_warm_from_disk_share_redis_per_tenant_and_stop_cleanly(
    tmp_path: Path, redis_url: str
) -> None:
    disk = tmp_path / "disk"
    flags = ["--redis", redis_url, "--redis-sync-writes"]
    first = serve(tmp_path, "first", "--disk-cache", str(disk), *flags)
    started: list[Served] = [first]
    try:
        wait_up(first)
        dtype = default_dtype()  # $PREFIXCACHE_DTYPE, else the machine's
        assert f"prefixcache: compute: runner llama, dtype {dtype} (" in first.log.read_text()
        assert "cpu, 1 threads, kernels: " in first.log.read_text()
        answer, prompt, cached = ask(first, ALPHA, "When does the sauna open?")
        assert answer.strip() and cached == 0
        first.stop()
        started.remove(first)
        with redis.Redis.from_url(redis_url) as r:  # what the restart reads can come from disk only
            assert r.dbsize() > 0
            r.flushall()

        restarted = serve(tmp_path, "restarted", "--disk-cache", str(disk), *flags)
        other = serve(tmp_path, "other", *flags)  # no disk: what it reads comes from Redis
        started += [restarted, other]
        wait_up(restarted, other)
        again = ask(restarted, ALPHA, "When does the sauna open?")
        assert again == (answer, prompt, (prompt - 1) // 16 * 16)  # warm from disk, same answer
        assert tier_hits(restarted, "disk") > 0 and tier_hits(restarted, "redis") == 0

        question = "How often does the cable car run?"
        alpha_answer, alpha_prompt, alpha_cached = ask(restarted, ALPHA, question, OTHER_SYSTEM)
        assert alpha_cached == 0
        # Redis now holds alpha's blocks of this prompt. Beta, the same prompt on another
        # process: nothing (its namespace differs); alpha there: every full block but the last token.
        assert ask(other, BETA, question, OTHER_SYSTEM)[2] == 0
        expected = (alpha_answer, alpha_prompt, (alpha_prompt - 1) // 16 * 16)
        assert ask(other, ALPHA, question, OTHER_SYSTEM) == expected
        assert tier_hits(other, "redis") > 0
        for s in (restarted, other):
            s.stop()
            started.remove(s)
    finally:
        for s in started:
            stop_process_tree(s.proc)
