"""Probe: decode attention on one K tensor of 2**32 elements (B=32, K=8, S=131072, H=128).

gpu_check's fp8 row at this shape hit CUDA_ERROR_ILLEGAL_ADDRESS (H200, 2026-11-30) while the
bf16 row at the same shape ran. Inputs here come from random bits (no float32 temporaries), so
a crash points at the kernel, not at input generation; with "host" the fp8 K and V are made
in numpy and copied in (no XLA program touches 2**32 one-byte elements before the kernel).
Usage: python gpu_probe_large.py DTYPE B S [host [bitcast]]
"""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jkv_kernels as pk

dtype, b, s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kh, g, h = 8, 4, 128
key = jax.random.key(0)
q = jax.random.normal(key, (b, kh * g, h), jnp.bfloat16)
shape = (b, kh, s, h)
lengths = jnp.full((b, kh), s, jnp.int32)
kw = {}
host = sys.argv[4:] == ["host"]
if dtype == "fp8" and host:  # a random 256 MiB block of finite codes, tiled on the host
    n = min(1 << 28, b * kh * s * h)
    block = np.random.default_rng(0).integers(0, 0x7F, n, dtype=np.uint8)
    block |= np.random.default_rng(1).integers(0, 2, n, dtype=np.uint8) << 7
    codes = np.tile(block, b * kh * s * h // n).reshape(shape).view(ml_dtypes.float8_e4m3fn)
    k = jax.device_put(codes)
    v = jax.device_put(codes[::-1].copy())
    sc = jax.random.uniform(key, (2, b, kh, s), jnp.float32, 0.001, 0.002)
    kw = dict(k_scale=sc[0], v_scale=sc[1])
elif dtype == "fp8":  # codes 0..0x7e: finite e4m3fn values of both signs
    bits = lambda i: jax.random.randint(jax.random.key(i), shape, 0, 0x7F, jnp.uint8)
    sign = lambda i: jax.random.bits(jax.random.key(i + 9), shape, jnp.uint8) & 0x80
    k = jax.lax.bitcast_convert_type(bits(1) | sign(1), jnp.float8_e4m3fn)
    v = jax.lax.bitcast_convert_type(bits(2) | sign(2), jnp.float8_e4m3fn)
    sc = jax.random.uniform(key, (2, b, kh, s), jnp.float32, 0.001, 0.002)
    kw = dict(k_scale=sc[0], v_scale=sc[1])
else:
    k = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
jax.block_until_ready((k, v))
print(
    f"inputs ready: {dtype} {shape} ({k.size} elements, 2**{k.size.bit_length() - 1})", flush=True
)
if sys.argv[5:] == ["bitcast"]:  # the kernel wrapper's own first step, alone
    bits = jax.jit(lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8))(k)
    total = jax.jit(lambda x: jnp.sum(x[:, :, -1].astype(jnp.int32)))(bits)
    print("bitcast to uint8 ran; last slots sum", int(total), flush=True)
out = jax.block_until_ready(pk.decode_attention(q, k, v, lengths, **kw))
print("kernel ran; finite:", bool(jnp.isfinite(out.astype(jnp.float32)).all()), flush=True)
# A slice through the reference: the last row's heads against the kernel's.
cut = lambda x: x[-1:] if x is not None else None
ref = pk.decode_attention_reference(cut(q), cut(k), cut(v), cut(lengths),
                                    **{n: cut(x) for n, x in kw.items()})  # fmt: skip
err = jnp.linalg.norm((out[-1:] - ref).astype(jnp.float32)) / jnp.linalg.norm(
    ref.astype(jnp.float32)
)
print(f"last row vs reference: rel err {float(err):.2e}", flush=True)
