"""The engine's programs kept on disk (`jkv.engine.programs`, what a restarted `jkv serve` loads
instead of tracing and compiling again) run as the program compiled in the process does, also
when JAX's own persistent cache already held the program: XLA:CPU serializes an executable JAX
read back from that cache without some of its functions, and every later start that loaded it
failed each request ("NOT_FOUND: Function wrapped_iota not found"; jax 0.10.2).

A subprocess: JAX's cache directory is process-wide configuration, and the suite's own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jkv.engine import programs

    d = Path(sys.argv[1])
    jax.config.update("jax_compilation_cache_dir", str(d / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


    @programs.jit
    def f(x, n):  # iotas, reductions and a loop with a data trip count, as the step has
        i = jnp.arange(x.shape[0])
        m = jnp.any((i[:, None] < n) & (x > 0), axis=0)
        body = lambda k, c: c + jnp.where(jnp.any(i < k), x.sum(0), 0.0)
        y = jax.lax.fori_loop(0, n, body, jnp.zeros(x.shape[1]))
        return y * m + jnp.argmax(x, axis=0)


    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)), jnp.float32)
    want = np.asarray(f(x, 5))  # jit: into JAX's persistent cache
    jax.clear_caches()
    programs.store_in(d / "programs")
    programs.compile(f, x, 5)  # a program to save, which JAX's cache holds
    assert len(list((d / "programs").iterdir())) == 1
    programs._table.clear()  # as a restart: the saved program read back
    programs.compile(f, x, 5)
    np.testing.assert_array_equal(np.asarray(programs.call(f, x, 5)), want)
    print("PROGRAMS-OK")
    """
)


def test_a_saved_program_runs_after_jaxs_cache_gave_it(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PROGRAMS-OK" in proc.stdout
