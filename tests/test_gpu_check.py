"""tools/gpu_check.py on the CPU (`--device cpu`), as `make test` runs it, so that the GPU acceptance run cannot rot.

On the CPU the same path runs with gloo, GlooSyncBatchNorm and the CPU's autocast (bf16). One toy model stands for
the nine (each runs the same lines), the full-size model is left out (minutes per step on 2 cores), and the planner
runs on the toy model; on a GPU `make gpu-check` runs them all. fp16 is left out here too: the CPU emulates its
convolutions (3.7 s a toy step against 0.25 in fp32, 59 of the check's 160 s, measured 2026-11-28), and it runs the
lines bf16 runs but for the GradScaler, whose skips reach the step log (tests/test_train_engine.py) that
`check_training` reads."""
import json

import pytest
import torch

from launch import REPO, explain, python

pytestmark = pytest.mark.slow

TOY = "toy/point_pillar_intermediate_fusion"
WARPING = "toy/point_pillar_v2vnet"


def test_gpu_check_on_the_cpu_passes_and_reports(toy_small, tmp_path):
    out = tmp_path / "report"
    result = python(REPO / "tools" / "gpu_check.py", "--device", "cpu", "--out", out, "--work", tmp_path / "work",
                    "--data", toy_small,
                    "--configs", TOY, "--full_size", "--precisions", "fp32", "bf16",
                    "--parity_kernels", "strict", "--repeat_configs", WARPING, "--planner_config", TOY,
                    "--loader_config", TOY, "--feed_config", TOY, "--feed_workers", "2", "--feed_steps", "8",
                    "--capture_configs", TOY,
                    timeout=1200)
    assert result.returncode == 0, explain(result)
    # The report alone in --out (a lent device machine returns a few files), the runs' folders under --work.
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md"]
    report = json.loads((out / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert all(c["status"] == "ok" for c in checks.values()), checks
    assert {"device", "process_group", "sync_batchnorm", "spconv", "cpu_weights", f"parity {TOY} strict",
            f"repeat {WARPING}", f"planner {TOY}", f"loader {TOY}", f"feed {TOY}", "voxelizer",
            f"capture cudagraphs {TOY}", f"capture_ddp cudagraphs {TOY}"} \
        <= set(checks)
    assert checks[f"repeat {WARPING}"]["figures"]["tensors"] > 0
    for precision in ("fp32", "bf16"):
        figures = checks[f"train {TOY} {precision}"]["figures"]
        assert figures["steps"] == 4 and figures["frames"] == 4  # 2 steps, 2 more after the resume; 4 test frames
        assert figures["samples_per_s"] > 0 and figures["peak_reserved_mib"] > 0
        # the step alone at batch 1 and 2 and its rate (issue 52); the CPU has no published peak
        assert all(figures[key] > 0 for key in ("step_ms_b1", "step_ms_b2", "tflops_b1", "tflops_b2",
                                                "ddp_step_ms_b1"))  # and in DDP at world size 1 (gloo here)
        assert figures["peak_tflops"] is None
        assert "scaler_skips" not in figures  # only fp16 has a GradScaler
    planner = checks[f"planner {TOY}"]["figures"]
    assert set(planner["probes"]) == {"1", "2", "4"} and planner["ratio"] > 0
    loader = checks[f"loader {TOY}"]["figures"]
    tried = [w for w in (0, 1, 2, 4, 8, 12) if w <= loader["cores"]]
    assert loader["step_samples_per_s"] > 0 and loader["default_workers"] == 2  # the CPU's default
    assert list(loader["paths"]) == ["ascii", "binary", "on_device"]  # the CPU path on both formats; the device's
    for path in loader["paths"].values():
        assert list(path["loader_samples_per_s"]) == [str(w) for w in tried]
        assert all(rate > 0 for rate in path["loader_samples_per_s"].values())
        fed = [w for w in tried if path["loader_samples_per_s"][str(w)] >= loader["step_samples_per_s"]]
        assert path["workers_to_feed"] == (fed[0] if fed else None)
    feed = checks[f"feed {TOY}"]["figures"]  # a real train_ddp run on the device path, 2 workers, 8 steps
    assert feed["steps"] == 8 and feed["workers"] == 2 and feed["train_samples_per_s"] > 0
    assert feed["ratio"] == pytest.approx(feed["train_samples_per_s"] / feed["step_samples_per_s"], rel=0.01)
    assert checks["voxelizer"]["figures"]["sorted_device_equals_cpu"] is True
    accumulation = checks[f"capture_accumulation {TOY}"]["figures"]  # the fit loop's 2 micro-batches, captured
    assert accumulation["mode"] == "cudagraphs" and len(accumulation["losses"]["captured"]) == 2
    # cudagraphs on the CPU: the graphs run on the eager kernels, so the first losses are eager's bit for bit
    assert not any(name.startswith(("capture compile", "capture_ddp compile")) for name in checks)
    capture = checks[f"capture cudagraphs {TOY}"]["figures"]
    in_ddp = checks[f"capture_ddp cudagraphs {TOY}"]["figures"]
    assert capture["mode"] == in_ddp["mode"] == "cudagraphs"
    assert capture["first_loss_gap_b1"] == capture["first_loss_gap_b2"] == in_ddp["first_loss_gap_ddp_b1"] == 0
    assert all(figures[f"{side}_ms_{key}"] > 0 for side in ("eager", "captured")
               for figures, key in ((capture, "b1"), (capture, "b2"), (in_ddp, "ddp_b1")))
    # the CPU has no CUDA graph: every forward graph the captured steps compile (one a step, more for the DDP
    # step, whose GlooSyncBatchNorm breaks its graph, fewer where dynamo's cache from a run before serves) is
    # skipped for the host, and for nothing else (torch checks mutations first)
    for figures in (capture, in_ddp):
        assert figures["cudagraph_skips"] >= 1, figures
        assert figures["cudagraph_skip_reasons"] and all("due to cpu device" in reason
                                                         for reason in figures["cudagraph_skip_reasons"]), figures
    # 2 GPUs at batch 1 against 1 at batch 2 (issue 52): the captured step in DDP at batch 1 against batch 2's
    assert in_ddp["two_at_b1_over_one_at_b2"] == pytest.approx(
        capture["captured_ms_b2"] / in_ddp["captured_ms_ddp_b1"], rel=0.01)
    assert report["environment"]["device"] == "cpu"
    table = (out / "gpu_check.md").read_text()
    assert "| sync_batchnorm | ok |" in table and "GlooSyncBatchNorm" in table
    assert f"| {TOY} | bf16 | ok |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: make gpu-check runs there")
def test_gpu_check_on_cuda_without_a_gpu_says_so(tmp_path):
    result = python(REPO / "tools" / "gpu_check.py", "--device", "cuda", "--out", tmp_path, timeout=300)
    assert result.returncode != 0
    assert "torch sees no CUDA device" in result.stderr and "--device cpu" in result.stderr, explain(result)

