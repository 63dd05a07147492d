#!/usr/bin/env python
"""The model zoo's figures (docs/model_zoo.md): per model, toy-world AP under one training budget, parameters of the
opv2v config, and its full-size step time and memory.

    python tools/benchmarks/benchmark_zoo.py --models intermediate where2comm ... [--epochs 8] [--out zoo_runs]

For each model: train its hypes_yaml/toy config on the demo toy world (torchrun, 2 processes, global batch 2,
`--epochs` epochs), evaluate the last checkpoint on the test split (2 processes), count the parameters of its
hypes_yaml/opv2v config, and time one forward+backward at full size with tools/benchmarks/benchmark_models.py (batch 1).
"none" is PointPillar on the ego's point cloud alone (the early-fusion config with train_params.max_cav 1): the
no-fusion baseline that shows what cooperation gains. One JSON line per model goes to --out/results.jsonl as
soon as it is measured, and a markdown table is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import yaml

from opencood_ddp.distributed.launch import launcher_prefix
from opencood_ddp.toy.config import split_set_flags
from opencood_ddp.toy.writer import toy_world_in

REPO = Path(__file__).resolve().parents[2]
# model -> (toy and opv2v config name, --fusion_method, fusion kind for the table, extra --set for the toy run)
MODELS = {
    "none": ("point_pillar_early_fusion", "early", "none (ego only)", ["train_params.max_cav=1"]),
    "early": ("point_pillar_early_fusion", "early", "early (raw points)", []),
    "late": ("point_pillar_late_fusion", "late", "late (boxes)", []),
    "intermediate": ("point_pillar_intermediate_fusion", "intermediate", "intermediate: AttFuse", []),
    "fcooper": ("point_pillar_fcooper", "intermediate", "intermediate: F-Cooper (max)", []),
    "v2vnet": ("point_pillar_v2vnet", "intermediate", "intermediate: V2VNet (GNN)", []),
    "v2xvit": ("point_pillar_v2xvit", "intermediate", "intermediate: V2X-ViT (transformer)", []),
    "cobevt": ("point_pillar_cobevt", "intermediate", "intermediate: CoBEVT (axial attention)", []),
    "where2comm": ("point_pillar_where2comm", "intermediate", "intermediate: Where2comm (sparse messages)", []),
    "second": ("second_intermediate_fusion", "intermediate", "intermediate: SECOND + AttFuse", []),
}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--data", default="data/toy_opv2v", help="the demo toy world (generated when absent)")
    parser.add_argument("--out", default="zoo_runs")
    parser.add_argument("--skip_full_size", action="store_true", help="leave out the full-size step timing")
    return parser.parse_args(argv)


def run(command: list, timeout: float = 7200) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"exit {result.returncode}: {' '.join(map(str, command[:8]))}\n{result.stderr[-3000:]}")
    return result


def torchrun(script: str, *args) -> list:
    return [*launcher_prefix(2), REPO / "tools" / script, *args]


def train_and_evaluate(model: str, args: argparse.Namespace) -> dict:
    config, fusion, _, extra = MODELS[model]
    run_dir = Path(args.out) / model
    sets = [item for value in extra for item in ("--set", value)]
    started = time.perf_counter()
    if not (run_dir / f"net_epoch{args.epochs}.pth").is_file():
        run(torchrun("train_ddp.py", "--hypes_yaml", REPO / "hypes_yaml" / "toy" / f"{config}.yaml",
                     "--model_dir", run_dir, "--num_workers", "0", "--set", "train_params.batch_size=2",
                     "--set", f"train_params.epoches={args.epochs}", *sets, *split_set_flags(Path(args.data))))
    train_seconds = time.perf_counter() - started
    run(torchrun("inference_ddp.py", "--model_dir", run_dir, "--fusion_method", fusion,
                 "--dataset_dir", Path(args.data) / "test", "--num_workers", "0"))
    found = yaml.safe_load((run_dir / "eval.yaml").read_text())
    steps = [line.split(",") for line in (run_dir / "train_steps.csv").read_text().splitlines()]
    header = steps[0]
    comm = [float(row[header.index("comm_rate")]) for row in steps[1:]] if "comm_rate" in header else []
    return {"ap30": found["ap30"], "ap50": found["ap_50"], "ap70": found["ap_70"],
            "train_wall_s": round(train_seconds, 1), "steps": len(steps) - 1,
            "comm_rate_last_epoch": round(sum(comm[-36:]) / len(comm[-36:]), 3) if comm else None}


def full_size(model: str) -> dict:
    config = MODELS[model][0]
    out = run([sys.executable, REPO / "tools" / "benchmarks" / "benchmark_models.py", "--configs", f"opv2v/{config}",
               "--batch-size", "1", "--repeats", "3"])
    row = [line for line in out.stdout.splitlines() if line.startswith(f"| opv2v/{config}")][0]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    return {"grid": cells[1], "parameters_m": float(cells[2].split()[0]), "step_s": float(cells[4]),
            "peak_mib": float(cells[6])}


def table(rows: list[dict], epochs: int) -> str:
    lines = [f"| model | fusion | parameters | AP@0.3 | AP@0.5 | AP@0.7 | toy train wall ({epochs} epochs, 2 ranks) | "
             "full-size fwd+bwd per sample (CPU) | peak memory (CPU) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['fusion']} | {r.get('parameters_m', '-')} M | {r['ap30']:.3f} | "
                     f"{r['ap50']:.3f} | {r['ap70']:.3f} | {r['train_wall_s']} s | {r.get('step_s', '-')} s | "
                     f"{r.get('peak_mib', '-')} MiB |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    toy_world_in(args.data, scale="demo")
    rows = []
    for model in args.models:
        row = {"model": model, "fusion": MODELS[model][2], "epochs": args.epochs}
        row.update(train_and_evaluate(model, args))
        if not args.skip_full_size and model != "none":
            row.update(full_size(model))
        rows.append(row)
        with open(Path(args.out) / "results.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    print(table(rows, args.epochs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
