"""The CUDA path end to end: 3 regions on one GPU, through `geotrain train`.

Protocol (fixed before any run):
- Three local regions of one worker each, all on GPU 0 (size-1 NCCL groups inside each
  region; across regions the codec over TCP: int8 + zstd + SM4-GCM), DiLoCo with H = 20.
- A Llama config of ~150M parameters (hidden 768, 12 layers, 12 heads, 4 KV heads, MLP
  2048) with the example's BPE tokenizer (examples/tiny-llama, 2048 tokens); token shards
  prepared from the interpreter's own pydoc topics by `geotrain data prepare`, one per
  region. Batch 16 x 512 tokens per region, 100 steps, AdamW, seed of the stack.
- Two runs side by side: fp32, and `parallel.autocast: bf16`. Each run's tokens/s is the
  three regions' tokens over the median step time; MFU = 6 x parameters x tokens/s over
  the GPU's dense bf16 peak (infra/model/gpus.py), the three regions sharing the one GPU.
  Peak memory is a region leader's `torch.cuda.max_memory_allocated`.
- The codec on GPU tensors: a 64M-value fp32 tensor on the GPU, encoded (quantize +
  zstd + SM4-GCM) two ways, best of 5: copied to the host first (what the exchange does
  today) and quantized on the GPU with only the int8 bytes copied (the codec's `_host`).

Run on a machine with one CUDA GPU: `python benchmarks/gpu.py` (under 8 minutes on an
H100); writes benchmarks/results/gpu.md. `--device cpu` runs the same protocol at a toy
size on CPU (a check of the script itself; its table goes to a temporary file unless
--out names one).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "gpu.md"
TOKENIZER = REPO / "examples" / "tiny-llama" / "tokenizer.json"
REGIONS = (("beijing", "CN"), ("frankfurt", "EU"), ("silicon-valley", "US"))


@dataclass(frozen=True)
class Size:
    model: dict[str, int]
    """Llama config overrides."""
    steps: int
    batch: int
    """Sequences per region and step."""
    seq: int
    codec_values: int
    """fp32 values the codec timing encodes."""


SIZES = {
    "cuda": Size(
        {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12},
        100,
        16,
        512,
        64 * 2**20,
    ),
    "cpu": Size(
        {"hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}, 6, 2, 64, 2**20
    ),
}
GPU_NAMES = (("H200", "H200"), ("H100", "H100-80GB"), ("A100", "A100-80GB"), ("L40S", "L40S"))
"""torch.cuda.get_device_name() substring -> geotrain's gpu_type (its peak FLOPs)."""


def model_dir(root: Path, device: str) -> Path:
    """A Llama config (no weights: trained from scratch) and the example's tokenizer."""
    vocab = len(json.loads(TOKENIZER.read_text())["model"]["vocab"])
    over = SIZES[device].model
    heads = over["num_attention_heads"]
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "intermediate_size": over["hidden_size"] * 8 // 3 // 64 * 64,
        "num_key_value_heads": 4 if heads % 4 == 0 else heads,
        "head_dim": over["hidden_size"] // heads,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        **over,
    }
    d = root / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(TOKENIZER, d / "tokenizer.json")
    return d


def gpu_type(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0)
    for needle, t in GPU_NAMES:
        if needle in name:
            return t
    raise SystemExit(f"no peak FLOPs known for {name}; add it to GPU_NAMES and gpus.py")


def stack(root: Path, name: str, device: str, autocast: str, model: Path) -> Path:
    z = SIZES[device]
    regions = [
        {
            "name": r,
            "jurisdiction": j,
            "subnet": f"10.42.{i + 1}.0/24",
            "asn": 64601 + i,
            "pool": {
                "kind": "local",
                "nodes": [
                    {
                        "name": f"{r[:3]}-0",
                        "address": "127.0.0.1",
                        "gpu_type": gpu_type(device),
                        "gpus": 1,
                    }
                ],
            },
        }
        for i, (r, j) in enumerate(REGIONS)
    ]
    doc = {
        "config": {
            "geotrain:regions": regions,
            "geotrain:training": {
                "model": f"hf:{model}",
                "sync": "diloco",
                "diloco": {"inner_steps": 20},
                "steps": z.steps,
                "batch_size": z.batch,
                "seq_len": z.seq,
                "lr": 0.0006,
                "parallel": {"autocast": autocast},
                "compression": {"quantize": "int8", "cipher": "sm4-gcm"},
                "checkpoint": {"interval_steps": z.steps, "keep": 2},
                "data_shards": [
                    {
                        "name": f"{r}-text",
                        "jurisdiction": j,
                        "region": r,
                        "uri": f"tokens:{root / 'data' / r}",
                        "source": "pydoc-topics:auto",
                    }
                    for r, j in REGIONS
                ],
            },
            "geotrain:monitoring": {"metrics_port": 0},
        }
    }
    path = root / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def geotrain(root: Path, *args: str) -> None:
    exe = Path(sys.executable).with_name("geotrain")  # the venv's console script
    r = subprocess.run([str(exe), *args], cwd=root, text=True, capture_output=True)
    if r.returncode:
        raise SystemExit(f"geotrain {' '.join(args)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def train(root: Path, name: str, device: str, peak_tflops: float) -> dict[str, Any]:
    z = SIZES[device]
    t0 = time.perf_counter()
    geotrain(root, "train", "--stack", str(root / f"Pulumi.{name}.yaml"), "--fresh")
    wall = time.perf_counter() - t0
    report = json.loads((root / ".geotrain" / name / "report.json").read_text())
    tps = len(REGIONS) * z.batch * z.seq / report["median_step_s"]
    flops = 6 * report["params"] * tps
    return {
        "params": report["params"],
        "tokens_per_s": tps,
        "mfu": flops / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_gib": report["peak_mem_bytes"] / 2**30,
        "step_s": report["median_step_s"],
        "loss": statistics.mean(report["final_loss_per_region"].values()),
        "wall_s": wall,
    }


def codec_rates(device: str) -> dict[str, float]:
    """GB/s of fp32 input through encode: host-first vs quantized on the device."""
    from training.comm.session import Session
    from training.spec import CodecSpec
    from training.sync.codec import Address, Codec

    n = SIZES[device].codec_values
    c = Codec(
        CodecSpec(quantize="int8", cipher="sm4-gcm"),
        bytes(range(32)),
        Session("gpu-bench", bytes(range(16)), 0),
    )
    x = torch.randn(n, device=device)
    out: dict[str, float] = {}
    for k, mode in enumerate(("host first", "on device")):
        best = float("inf")
        for step in range(10 * k, 10 * k + 5):  # a nonce address once each
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            src = x.cpu() if mode == "host first" else x
            c.encode(src, Address(stage=0, epoch=0, step=step, bucket=0, source=0, dest=1))
            best = min(best, time.perf_counter() - t0)
        out[mode] = 4 * n / best / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run on a GPU machine, or --device cpu")
    out = a.out or (OUT if a.device == "cuda" else Path(tempfile.mkdtemp()) / "gpu.md")
    from infra.model.gpus import GPU_TYPES

    kind = gpu_type(a.device)
    peak = GPU_TYPES[kind].peak_bf16_tflops
    with tempfile.TemporaryDirectory(prefix="geotrain-gpu-") as tmp:
        root = Path(tmp)
        model = model_dir(root, a.device)
        for mode in ("fp32", "bf16"):
            stack(root, f"gpu-{mode}", a.device, "none" if mode == "fp32" else mode, model)
        geotrain(root, "data", "prepare", "--stack", str(root / "Pulumi.gpu-fp32.yaml"))
        runs = {m: train(root, f"gpu-{m}", a.device, peak) for m in ("fp32", "bf16")}
    codec = codec_rates(a.device)
    z, n = SIZES[a.device], SIZES[a.device].codec_values
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    lines = [
        "# The CUDA path: 3 regions on one GPU (benchmarks/gpu.py)",
        "",
        f"Device: {name} ({kind}, dense bf16 peak {peak:g} TFLOP/s). Llama config, "
        f"{runs['fp32']['params'] / 1e6:.1f}M parameters; 3 regions x 1 worker on the one "
        f"device; DiLoCo H=20, int8+zstd+SM4-GCM across regions; batch {z.batch} x {z.seq} "
        f"per region, {z.steps} steps.",
        "",
        "| precision | tokens/s (3 regions) | MFU | peak GiB (a leader) | median step s "
        "| final loss | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in runs.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {m} | {r['tokens_per_s']:.0f} | {mfu} | {r['peak_gib']:.2f} | "
            f"{r['step_s']:.3f} | {r['loss']:.3f} | {r['wall_s']:.0f} |"
        )
    ratio = runs["bf16"]["tokens_per_s"] / runs["fp32"]["tokens_per_s"]
    lines += [
        "",
        f"bf16 autocast / fp32 tokens/s: {ratio:.2f}x.",
        "",
        f"Codec on {n / 2**20:.0f}M fp32 values on the {a.device} device (int8 + zstd + "
        "SM4-GCM encode, best of 5, GB/s of fp32 input):",
        "",
        "| mode | GB/s |",
        "|---|---|",
        *(f"| {m} | {v:.2f} |" for m, v in codec.items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
