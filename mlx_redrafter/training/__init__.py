"""Training a drafter against a frozen target, one module per phase:

* `data`: distilled sequences, windows and the target's hidden states (cached),
  the draft vocabulary, the validation split, host micro-batches;
* `parallel`: how the data is dealt into micro-batches and `mx.distributed` ranks;
* `loss`: the teacher-forced batch, the target's soft labels, the loss;
* `config`: the trainers' settings;
* `loop`: the optimizer step, `train` (the full trainer) and `fit` (a minimal run
  through the same step);
* `evaluate`: validation, the run's report, tau by decoding;
* `checkpoints`: atomic checkpoints and resume;
* `export`: the trained drafter, its n-gram table and JSON reports on disk.
"""

from .checkpoints import (
    CheckpointError,
    latest_checkpoint,
    read_checkpoint,
    refuse_to_overwrite,
    write_checkpoint,
)
from .config import FitConfig, TrainConfig
from .data import (
    HostBatch,
    TrainingSequence,
    VocabChoice,
    Window,
    choose_draft_vocab,
    compute_hidden,
    draft_vocabulary,
    held_out_prompts,
    host_batch,
    make_window,
    split_validation,
    training_replies,
    training_sequences,
    vocab_coverage,
    windows_with_hidden,
)
from .evaluate import (
    TauResult,
    TrainReport,
    evaluate,
    measure_tau,
    measure_trees,
    run_summary,
    tau_prompts,
    validate,
)
from .export import EXPORT_DTYPES, export_drafter, save_ngrams, write_json
from .loop import clip_gradients, fit, new_drafter, optimizer_step, train
from .loss import DraftBatch, SoftHead, SoftTargets, draft_batch, draft_loss, soft_head

__all__ = [
    "EXPORT_DTYPES",
    "CheckpointError",
    "DraftBatch",
    "FitConfig",
    "HostBatch",
    "SoftHead",
    "SoftTargets",
    "TauResult",
    "TrainConfig",
    "TrainReport",
    "TrainingSequence",
    "VocabChoice",
    "Window",
    "choose_draft_vocab",
    "clip_gradients",
    "compute_hidden",
    "draft_batch",
    "draft_loss",
    "draft_vocabulary",
    "evaluate",
    "export_drafter",
    "fit",
    "held_out_prompts",
    "host_batch",
    "latest_checkpoint",
    "make_window",
    "measure_tau",
    "measure_trees",
    "new_drafter",
    "optimizer_step",
    "read_checkpoint",
    "refuse_to_overwrite",
    "run_summary",
    "save_ngrams",
    "soft_head",
    "split_validation",
    "tau_prompts",
    "train",
    "training_replies",
    "training_sequences",
    "validate",
    "vocab_coverage",
    "windows_with_hidden",
    "write_checkpoint",
    "write_json",
]
