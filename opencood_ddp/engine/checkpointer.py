"""RunCheckpointer: every file of a run that is not a log, written by rank 0, and the resume that reads them back,
with what a resume decides: which checkpoint to continue from, a history without one refused, a changed model or
data section refused (or allowed with a warning), another effective batch warned about.

It writes config.yaml, the epoch checkpoints (`net_epoch{N}.pth` with its training state), the one best-val
weights file and the mid-epoch checkpoints (stop signal, --max_steps, a non-finite stop), all atomically through
checkpoint_files.py's file layer; it removes the temporary files a killed save left. The save methods are
collective: every rank calls them (each rank's RNG state is gathered into the checkpoint), only rank 0 writes, and
a barrier ends each save, so that no rank starts the next epoch, or exits, while rank 0 still writes.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from torch import nn

from opencood_ddp import hypes as hypes_lib
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import BatchPlan
from opencood_ddp.engine.logs import STEP_LOG_NAME, get_logger
from opencood_ddp.engine.run_dir import CONFIG_NAME
from opencood_ddp.errors import CheckpointError, ConfigError, first_line
from opencood_ddp.hypes import changed_sections


@dataclass
class Resumed:
    """What resume found: the checkpoint that loaded (None: start from scratch), its training state (None: an
    upstream run, weights only), why newer checkpoints were passed over, and whether the run fine-tunes: its
    model section changed under --allow_config_change, so that only the weights carry over (the optimizer
    restarts) and `new_parameters` are the model's entries the checkpoint did not hold."""

    saved: Optional[ckpt.SavedCheckpoint] = None
    state: Optional[dict] = None
    passed_over: list = field(default_factory=list)
    fine_tune: bool = False
    new_parameters: list = field(default_factory=list)


@dataclass(frozen=True)
class ResumeRules:
    """What a resume checks against: the hypes sections' digests of this run, its effective batch, whether a
    changed model or data section is accepted (--allow_config_change), and whether a history without a checkpoint
    is trained anew (--restart)."""

    config_digests: Optional[dict] = None  # None: nothing is compared
    global_batch: Optional[int] = None
    allow_config_change: bool = False
    restart: bool = False  # a history without a checkpoint is trained anew (--restart)
    restarted_job: bool = False  # a torchrun restart: the history may be its own earlier attempt's (RunSetup)


class RunCheckpointer:
    def __init__(self, run_dir: Path, is_main: bool, keep_states: int = 2, rules: ResumeRules = ResumeRules()):
        self.run_dir, self.is_main, self.keep_states, self.rules = Path(run_dir), is_main, keep_states, rules
        # The run's newest weights (the same on every rank): the checkpoint it resumed from, then each one it writes.
        # --eval_after_training evaluates them, also when a resume had nothing left to train.
        self.last_weights: Optional[Path] = None
        self.log = get_logger()

    # ------------------------------------------------------------------------------------------------ config
    def write_config(self, hypes: dict, plan: BatchPlan) -> None:
        """config.yaml: the hypes as trained, with the batch plan (rank 0)."""
        if self.is_main:
            hypes_lib.save_hypes(dict(hypes, batch_plan=plan.as_dict()), self.run_dir / CONFIG_NAME)

    def remove_unfinished_saves(self) -> list[str]:
        """The temporary files of saves a killed run left (rank 0; other ranks get [])."""
        return ckpt.remove_unfinished_saves(self.run_dir) if self.is_main else []

    # ------------------------------------------------------------------------------------------------ resume
    def resume(self, model: nn.Module, steps_per_epoch: int) -> Resumed:
        """Load the newest checkpoint that loads into `model` (unwrapped). A truncated or corrupt file, or one
        holding another model's weights (a file copied in by mistake), is passed over for the one before it, and
        the caller warns with its name; when none loads, a CheckpointError names them. Every rank reads the same
        files and so takes the same one."""
        rejected: list = []
        for saved in ckpt.saved_checkpoints(self.run_dir, steps_per_epoch):
            try:
                weights, state = ckpt.load_saved(saved)
                changed = self._check_state(saved, state) if state is not None else []
                fine_tune = "model" in changed  # only reached with --allow_config_change
                # nothing is loaded on a mismatch; a fine-tune may add entries (a compressor) to the model
                new = ckpt.load_weights(model, weights, label=str(saved.weights), allow_new=fine_tune)
            except (ckpt.CorruptCheckpointError, ckpt.ForeignCheckpointError) as exc:
                rejected.append(_what_it_holds(exc, saved, model))
                continue
            if fine_tune:
                self.log.warning(f"model section changed: fine-tuning from the weights of {saved.weights.name} "
                                 f"({len(new)} new entries start from their initial values"
                                 f"{': ' + ', '.join(new[:4]) + (' ...' if len(new) > 4 else '') if new else ''});"
                                 f" the optimizer restarts, the epoch count and lr schedule go on")
            self.last_weights = saved.weights
            return Resumed(saved, state, [exc.problem for exc in rejected], fine_tune, new)
        if rejected:
            more = f" (and {len(rejected) - 1} more)" if len(rejected) > 1 else ""
            raise CheckpointError(f"{rejected[0].problem}{more}, and no earlier checkpoint of this run loads; restore "
                                  f"or delete those files to train {self.run_dir} from the start")
        self._refuse_a_history_without_checkpoint()
        return Resumed()

    def _check_state(self, saved: ckpt.SavedCheckpoint, state: dict) -> list:
        """The hypes sections changed since the checkpoint. A model or data section edited since the checkpoint
        (config.yaml, or --set on resume) is refused, since weights that happen to fit another model would train
        on silently as that model; --allow_config_change resumes with a warning (a changed model section then
        fine-tunes: upstream's recipes change the model between stages, compression and backbone_fix).
        Checkpoints written before digests were recorded are not checked. Another effective batch is allowed,
        with a warning: the resumed part is not the same training."""
        digests, rules = state.get("config_digests"), self.rules
        changed = changed_sections(digests, rules.config_digests) if None not in (digests, rules.config_digests) \
            else []
        if changed:
            what = (f"{saved.weights.name} was trained with other hypes sections {', '.join(changed)} than this run "
                    f"has now")
            if not rules.allow_config_change:
                raise ConfigError(f"{what}; restore them in {self.run_dir / CONFIG_NAME} (or drop the --set), or "
                                  f"pass --allow_config_change to resume anyway")
            self.log.warning(f"{what}; resuming anyway (--allow_config_change)")
        trained = state.get("batch_plan", {}).get("global_batch")
        if trained is not None and rules.global_batch is not None and trained != rules.global_batch:
            self.log.warning(f"this run was trained with effective batch {trained}; the resumed part uses "
                             f"{rules.global_batch}: not the same training")
        return changed

    def _refuse_a_history_without_checkpoint(self) -> None:
        """A run folder whose train_steps.csv has steps but that holds no checkpoint (they were deleted, or the
        job died before its first save) would train from scratch under the word "resuming" and replace that
        history. Refused unless --restart, or unless this is torchrun restarting the job that wrote it."""
        steps_file = self.run_dir / STEP_LOG_NAME
        steps = max(0, len(steps_file.read_text().splitlines()) - 1) if steps_file.is_file() else 0
        if not steps or self.rules.restart or self.rules.restarted_job:
            return
        raise ConfigError(f"run folder {self.run_dir} has a history ({STEP_LOG_NAME}: {steps} steps) but no "
                          f"checkpoint (net_epoch<N>.pth or net_step<K>.pth); restore its checkpoints, or pass "
                          f"--restart to train it from the start and replace that history")

    # ------------------------------------------------------------------------------------------------ saves
    def save_epoch(self, epoch: int, model: nn.Module, training_state: Callable[[], dict], due: bool,
                   new_best: Optional[float]) -> None:
        """Collective. `due`: write net_epoch{epoch}.pth and its training state (`training_state()` is called on
        rank 0 only); `new_best`: this epoch's validation loss is the run's best, replace the best-val weights."""
        rng = comm.gather_objects(ckpt.rng_state(ckpt.device_of(model))) if due else None
        if due:
            self.last_weights = self.run_dir / ckpt.weights_name(epoch)

        def write() -> None:
            if due:
                path = ckpt.save_epoch(self.run_dir, epoch, model, dict(training_state(), rng=rng), self.keep_states)
                self.log.info(f"saved {path}")
            if new_best is not None:
                self.log.info(f"new best validation loss {new_best:.4f}: saved "
                              f"{ckpt.save_bestval(self.run_dir, epoch, model)}")

        self._agree_on(write, model)

    def save_mid_epoch(self, model: nn.Module, training_state: Callable[[], dict], global_step: int, epoch: int,
                       step_in_epoch: int) -> Path:
        """Collective: net_step{global_step}.pth and its training state, `epoch` epochs done plus `step_in_epoch`
        steps of the next; every rank's RNG goes with it."""
        rng = comm.gather_objects(ckpt.rng_state(ckpt.device_of(model)))
        self.last_weights = self.run_dir / ckpt.step_weights_name(global_step)
        self._agree_on(lambda: ckpt.save_step(self.run_dir, global_step, model, dict(training_state(), rng=rng),
                                              epoch=epoch, step_in_epoch=step_in_epoch), model)
        return self.last_weights

    def _agree_on(self, write: Callable[[], object], model: nn.Module) -> None:
        """Rank 0 writes; then every rank learns whether it could (in place of a barrier), so a full disk is one
        error on every rank instead of a rank 0 traceback and peers blaming a 'stalled' rank 0."""
        error = None
        if self.is_main:
            try:
                write()
            except (OSError, RuntimeError) as exc:  # torch.save on a full disk: RuntimeError "unexpected pos"
                error = CheckpointError(self._no_room(exc, model))
        error = comm.first_error(error)
        if error is not None:
            raise error

    def _no_room(self, exc: BaseException, model: nn.Module) -> str:
        free = shutil.disk_usage(self.run_dir).free
        kept = ", ".join(sorted(p.name for p in self.run_dir.glob("net_*.pth"))) or "none"
        # A new run that saved nothing has its folder removed (run_dir.remove_if_nothing_saved): nothing to resume.
        then = f"resume with --model_dir {self.run_dir}" if kept != "none" else "run the command again"
        return (f"cannot write a checkpoint into {self.run_dir} ({first_line(exc)}); {free / 2 ** 20:.0f} MiB free on "
                f"its disk, and a checkpoint of this model needs about {_mib(self._checkpoint_mib(model))} MiB; the "
                f"checkpoints already saved are intact ({kept}): free space, then {then}")

    def _checkpoint_mib(self, model: nn.Module) -> float:
        """The size of the newest weights file and its training state; before the run's first save, three times
        the model's tensors (the weights, and a training state that holds Adam's two moments of each)."""
        saved = sorted(self.run_dir.glob("net_*.pth"), key=lambda p: p.stat().st_mtime)
        states = sorted(self.run_dir.glob("training_state_*.pt"), key=lambda p: p.stat().st_mtime)
        if saved and states:
            return (saved[-1].stat().st_size + states[-1].stat().st_size) / 2 ** 20
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        return 3 * weights / 2 ** 20


def _mib(value: float) -> str:
    """Whole MiB for real models; two digits for a small one, which would otherwise read 'needs about 0 MiB'."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _what_it_holds(exc: CheckpointError, saved: ckpt.SavedCheckpoint, model: nn.Module) -> CheckpointError:
    """A readable weights file that is not the one its training state recorded was put there by hand: say
    whether it is another model's (the usual case: a file copied from another run) rather than 'corrupt'."""
    weights = getattr(exc, "weights", None)
    if weights is None:
        return exc
    report = ckpt.describe_mismatch(model.state_dict(), ckpt.strip_module_prefix(weights))
    if not report:
        return exc
    return ckpt.ForeignCheckpointError(f"checkpoint {saved.weights} does not match the model: {report}",
                                       "restore the file this run saved")

