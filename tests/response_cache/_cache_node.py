"""A cache node for the multi-process tests: `python _cache_node.py REDIS_URL NODE_ID`.

Reads one JSON command per line on stdin, answers one JSON line on stdout. Its generate
function returns "<node_id>:<prompt>" and counts calls, so tests can see who generated.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

# Import jkv.response_cache without running jkv/__init__.py (JAX): the cache must not need it, and
# a node then starts in a fraction of a second.
_stub = types.ModuleType("jkv")
_stub.__path__ = [str(Path(__file__).resolve().parents[2] / "jkv")]
sys.modules.setdefault("jkv", _stub)

from jkv.response_cache import ResponseCache  # noqa: E402

SETTINGS = {"temperature": 0.0, "max_new_tokens": 16}


def main() -> None:
    url, node_id = sys.argv[1], sys.argv[2]
    cache = ResponseCache(url, node_id=node_id)
    generated = 0

    def generate_for(prompt: str, delay: float):
        def generate():
            nonlocal generated
            generated += 1
            time.sleep(delay)
            return {"text": f"{node_id}:{prompt}", "tokens": [1, 2, 3], "finish_reason": "stop"}

        return generate

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            reply: dict = {"ok": True}
            model = cmd.get("model", "demo")
            settings = cmd.get("settings", SETTINGS)
            if op == "get_or_generate":
                fn = generate_for(cmd["prompt"], cmd.get("delay", 0.0))
                found = cache.get_or_generate(
                    model, "v1", cmd["prompt"], settings, fn, group_id=cmd.get("group")
                )
                reply.update(text=found.record.text, level=found.level)
            elif op == "get":
                found = cache.get(model, "v1", cmd["prompt"], settings)
                reply.update(level=found.level if found else None)
                reply.update(text=found.record.text if found else None)
            elif op == "invalidate_model":
                job = cache.invalidate_model(model)
                reply.update(generation=job.generation)
                if cmd.get("wait"):
                    reply.update(removed=job.wait(120))
            elif op == "invalidate_group":
                reply.update(removed=cache.invalidate_group(model, cmd["group"]))
            elif op == "stats":
                reply.update(stats=cache.stats(), generated=generated)
            elif op == "exit":
                cache.close()
                print(json.dumps(reply), flush=True)
                return
        except Exception as e:  # reported to the test, which fails with the message
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    cache.close()


if __name__ == "__main__":
    main()
