"""Issue 18 benchmark: what secure aggregation costs, and what homomorphic encryption would.

1. The cross-region sync of one bucket on a real 3-region gloo world on this machine, side
   by side in one run: the int8 (int4) codec as it is, the shared-scale integer sum
   without masks, and the masked (secure) sum. Cross-region bytes per parameter and
   seconds per sync (mean over the rounds; the first round, which exchanges the X25519
   keys, is left out).
2. zstd-1 on the bytes each path sends: masked words are uniform, so they do not compress.
3. The mask keystream (SM4-CTR, AES-CTR) per core.
4. Homomorphic encryption per parameter on this machine: Paillier (`phe`, 2048-bit n) and
   CKKS (TenSEAL, N = 8192), each if it is installed (pip install phe tenseal).

Run: python benchmarks/secagg.py [--numel 1048576 --rounds 5]. Prints a table and saves it
to benchmarks/results/secagg.md. Gradients are Student-t (3 degrees of freedom) samples:
heavy-tailed like real gradients, so the int8 values compress as real ones do.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import zstandard

from training.comm.topology import Topology, make_groups
from training.spec import CodecSpec
from training.sync.codec import Codec
from training.sync.hier import HierarchicalAllReduce
from training.sync.secagg import Masker, Round, keystream, shared_quantize
from training.testing import make_spec, run_world

REGIONS = 3
KEY = bytes(range(32))
RESULTS = Path(__file__).parent / "results"
MODES = [
    ("int8", "codec"),
    ("int8", "shared-scale"),
    ("int8", "secure"),
    ("int4", "codec"),
    ("int4", "secure"),
]


def gradient(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) / torch.sqrt(torch.randn(n, 3, generator=g).pow(2).mean(1))
    return t * 1e-3  # Student-t, 3 degrees of freedom


def sync_world(rank: int, world: int, numel: int, rounds: int) -> dict[str, Any]:
    launch = make_spec(REGIONS, 1)
    topo = Topology.of(launch, rank)
    groups = make_groups(topo, torch.device("cpu"))
    syncs = {}
    for quant, mode in MODES:
        cs = CodecSpec(quantize=quant, secure_aggregation=mode != "codec")
        syncs[(quant, mode)] = s = HierarchicalAllReduce(topo, groups, Codec(cs, KEY), "bench")
        if mode == "shared-scale":
            assert s.secure is not None
            s.secure.masked = False
    out: dict[str, Any] = {}
    for step in range(rounds + 1):  # round 0: key exchange, warm-up; not counted
        x = gradient(numel, 100 * step + rank)
        for key, s in syncs.items():  # interleaved: the machine is shared
            t0 = time.perf_counter()
            s.all_reduce(x, step=step)
            dt = time.perf_counter() - t0
            if step == 0:
                s.stats.cross_wire_bytes = 0
                continue
            row = out.setdefault(key, {"s": 0.0, "bytes": 0})
            row["s"] += dt / rounds
    for key, s in syncs.items():
        out[key]["bytes"] = s.stats.cross_wire_bytes / rounds / numel
    return out


def zstd_lines(numel: int) -> list[str]:
    """Bytes each path puts into zstd for one piece, and what zstd-1 makes of them."""
    x = gradient(numel, 1)
    block = 256
    absmax = torch.nn.functional.pad(x.abs(), (0, (-numel) % block)).view(-1, block).amax(1)
    q, _ = shared_quantize(x, absmax / 127, 127, block)
    privs = _pair_secrets()
    masked = Masker(0, privs, bytes(32), "sm4-gcm").mask(q, Round(0, 1, 0), 0)
    zc = zstandard.ZstdCompressor(level=1)
    rows = [
        ("int8 values (codec, 1 byte each)", q.to(torch.int8).numpy().tobytes()),
        ("int16 words, unmasked (shuffled)", _shuffle16(q.to(torch.int16))),
        ("int16 words, masked (shuffled)", _shuffle16(masked)),
    ]
    lines = ["| bytes sent | raw bytes/value | after zstd-1 | zstd saves |", "|---|---|---|---|"]
    for name, raw in rows:
        z = len(zc.compress(raw))
        lines.append(
            f"| {name} | {len(raw) / numel:.2f} | {z / numel:.3f} | {1 - z / len(raw):.1%} |"
        )
    return lines


def _shuffle16(v: torch.Tensor) -> bytes:
    return v.view(torch.uint8).view(-1, 2).t().contiguous().numpy().tobytes()


def _pair_secrets() -> dict[int, bytes]:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    me = X25519PrivateKey.generate()
    return {k: me.exchange(X25519PrivateKey.generate().public_key()) for k in (1, 2)}


def keystream_lines(numel: int) -> list[str]:
    lines = ["| PRG | keystream MB/s (one core) |", "|---|---|"]
    for cipher, name in (("sm4-gcm", "SM4-CTR"), ("aes-gcm", "AES-256-CTR")):
        best = min(_timed(lambda c=cipher: keystream(bytes(32), numel, c)) for _ in range(3))
        lines.append(f"| {name} | {2 * numel / best / 1e6:.0f} |")
    return lines


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


DEMO_PARAMS = 2_452_992
"""The demo model's parameters (benchmarks/results/codec_and_sync.md)."""


def paillier_row(values: int) -> tuple[str, float, float, float, float] | None:
    try:
        from phe import paillier
    except ImportError:
        return None
    pub, priv = paillier.generate_paillier_keypair(n_length=2048)
    xs = [float(v) for v in gradient(values, 2)]
    t0 = time.perf_counter()
    cs = [pub.encrypt(int(v * 1e6)) for v in xs]  # fixed point: HE sums integers too
    enc = (time.perf_counter() - t0) / values
    t0 = time.perf_counter()
    total = [a + b for a, b in zip(cs, cs, strict=True)]
    add = (time.perf_counter() - t0) / values
    t0 = time.perf_counter()
    for c in total[:20]:
        priv.decrypt(c)
    dec = (time.perf_counter() - t0) / 20
    size = (2 * 2048) // 8  # a ciphertext lives mod n^2
    return ("Paillier 2048 (phe + gmpy2), one value per ciphertext", enc, add, dec, size)


def ckks_row() -> tuple[str, float, float, float, float] | None:
    try:
        import tenseal as ts
    except ImportError:
        return None
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40, 60])
    ctx.global_scale = 2**40
    slots = 4096
    xs = gradient(slots, 3).tolist()
    t0 = time.perf_counter()
    vs = [ts.ckks_vector(ctx, xs) for _ in range(5)]
    enc = (time.perf_counter() - t0) / 5 / slots
    t0 = time.perf_counter()
    s = vs[0]
    for v in vs[1:]:
        s = s + v
    add = (time.perf_counter() - t0) / 4 / slots
    t0 = time.perf_counter()
    s.decrypt()
    dec = (time.perf_counter() - t0) / slots
    size = len(vs[0].serialize()) / slots
    return ("CKKS N=8192 (TenSEAL), 4,096 values per ciphertext", enc, add, dec, size)


def he_lines(he: list[tuple[str, float, float, float, float]], secure: dict[str, Any]) -> list[str]:
    lines = [
        "| scheme | encrypt µs | add µs | decrypt µs | ciphertext bytes |",
        "|---|---|---|---|---|",
    ]
    for name, enc, add, dec, size in he:
        lines.append(
            f"| {name} | {enc * 1e6:.2f} | {add * 1e6:.3f} | {dec * 1e6:.2f} | {size:.1f} |"
        )
    extra_s = secure["secure"]["s"] - secure["codec"]["s"]  # per bucket of --numel values
    lines += [
        "",
        f"Per sync of the demo model ({DEMO_PARAMS:,} parameters), one region, one core:",
        "",
        "| method | extra s per sync (wall, one core) | bytes per parameter (masks: all peers, "
        "both stages; HE: one ciphertext copy) |",
        "|---|---|---|",
        f"| pairwise masks (measured above, int8) | {extra_s * DEMO_PARAMS / secure['n']:.2f} "
        f"| {secure['secure']['bytes']:.2f} (all peers together) |",
    ]
    for name, enc, _, _, size in he:
        lines.append(
            f"| {name.split(',')[0]}: encryption alone | {enc * DEMO_PARAMS:,.0f} | {size:.0f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--paillier-values", type=int, default=200)
    a = ap.parse_args()
    res = run_world(sync_world, REGIONS, a.numel, a.rounds, timeout=600)[0]
    base = {q: res[(q, "codec")] for q in ("int8", "int4")}
    lines = [
        f"# Secure aggregation, one bucket of {a.numel:,} fp32 values, {REGIONS} regions x 1 "
        f"rank (gloo on this machine), mean of {a.rounds} syncs",
        "",
        "| quantize | scatter stage | cross-region bytes/param/sync | vs codec | s/sync "
        "| vs codec |",
        "|---|---|---|---|---|---|",
    ]
    for (q, mode), r in res.items():
        b = base[q]
        lines.append(
            f"| {q} | {mode} | {r['bytes']:.3f} | {r['bytes'] / b['bytes']:.2f} | "
            f"{r['s']:.3f} | {r['s'] / b['s']:.2f} |"
        )
    lines += ["", "## zstd-1 on what crosses the border (one piece, Student-t values)", ""]
    lines += zstd_lines(a.numel // REGIONS)
    lines += ["", "## Mask keystream", ""]
    lines += keystream_lines(a.numel)
    lines += ["", "## Homomorphic encryption per parameter, one core", ""]
    he = [r for r in (paillier_row(a.paillier_values), ckks_row()) if r is not None]
    secure = {"codec": res[("int8", "codec")], "secure": res[("int8", "secure")], "n": a.numel}
    lines += he_lines(he, secure)
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "secagg.md").write_text(text)


if __name__ == "__main__":
    main()
