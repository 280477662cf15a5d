"""What each rule of the flag contract (:mod:`.flag_contract`) does in either loop: ``(in Megatron-LM's loop, in
the built-in loop, how or why)``, each loop's treatment one of ``honored`` (same meaning), ``mapped`` (the flag's
intent, carried out Spindle's way), ``refused`` (one line naming the flag and what to use instead, exit status 2)
or ``no effect`` (by nature; the text says why). The flags under each rule are in :mod:`.flag_table`.

Pure data: no import.
"""
HONORED, MAPPED, REFUSED, NO_EFFECT = "honored", "mapped", "refused", "no effect"

RULES: dict[str, tuple[str, str, str]] = {  # rule: (Megatron-LM's loop, the built-in loop, how or why)
    "batch": (HONORED, HONORED,
        'samples of every task: --micro-batch-size per rank in one pass of the plan (a pass carries it x '
        "ranks), --global-batch-size per optimizer step (the plan's passes x micro x ranks)"),
    "length": (HONORED, HONORED,
        "the run's optimizer steps; --train-samples counts samples of every task, over the global batch"),
    "lr": (HONORED, HONORED,
        "megatron.core's OptimizerParamScheduler built from these flags as Megatron-LM builds it"),
    "lr_mlm": (HONORED, REFUSED,
        "Megatron-LM's scheduler and optimizer take them; the built-in loop does not: run Megatron-LM's loop "
        '(SPINDLE_BACKEND=megatron) or drop the flag'),
    "optim": (HONORED, HONORED,
        "AdamW with these settings (Megatron's optimizer config in its loop); --clip-grad clips by the global "
        'norm over every parameter, each shard counted once'),
    "optimizer": (REFUSED, REFUSED,
        'Spindle trains with Adam (AdamW, --optimizer adam)'),
    "seed": (HONORED, HONORED,
        'model and data seed: the same initial weights and samples on every plan'),
    "layers": (HONORED, HONORED,
        "the layers' TransformerConfig (init_method_std, hidden_dropout, attention_dropout) in every MetaOp"),
    "per_token": (HONORED, HONORED,
        "each task's loss is summed over its tokens and divided by the global token count, as Megatron-LM "
        'does'),
    "eval": (HONORED, HONORED,
        "every --eval-interval steps, --eval-iters batches of every task, forward only, each task's "
        'validation loss logged'),
    "exit": (HONORED, HONORED,
        'stop at a multiple of --exit-interval (after a checkpoint with --save); --exit-signal-handler: '
        'finish the step, save and exit 0 on SIGTERM'),
    "exit_mlm": (HONORED, REFUSED,
        "Megatron-LM's loop does this itself; the built-in loop does not: run Megatron-LM's loop "
        '(SPINDLE_BACKEND=megatron) or drop the flag'),
    "bf16": (HONORED, HONORED,
        'bf16 parameters and activations, fp32 master weights, losses, gradient reductions and optimizer '
        "(Megatron's mixed precision)"),
    "fp16": (REFUSED, REFUSED,
        "the wave executor applies no dynamic loss scaling (fp16 would overflow silently): use --bf16, with "
        'fp32 master weights, losses and gradient reductions as Megatron-LM'),
    "fp32_grads": (HONORED, HONORED,
        'gradients accumulated and reduced in fp32 (always so under --bf16)'),
    "loss_scale": (REFUSED, REFUSED,
        'the wave executor scales no loss (--fp16 is refused; --bf16 needs no scaling): drop the flag'),
    "ckpt": (HONORED, HONORED,
        "sharded torch_dist checkpoints of every rank's slices, resumable under another plan "
        '(docs/training.md)'),
    "ckpt_mlm": (HONORED, REFUSED,
        "Megatron-LM's checkpointing takes it (the chunk's sharded state dict); the built-in loop's does not: "
        "run Megatron-LM's loop (SPINDLE_BACKEND=megatron) or drop the flag"),
    "ckpt_other": (REFUSED, REFUSED,
        'Spindle checkpoints are torch_dist (sharded), saved and loaded with --save/--load'),
    "log": (HONORED, HONORED,
        "rank 0's progress lines every --log-interval steps; TensorBoard and W&B events as Megatron-LM writes "
        'them'),
    "log_mlm": (HONORED, REFUSED,
        "Megatron-LM's training_log does this; the built-in loop does not: run Megatron-LM's loop "
        '(SPINDLE_BACKEND=megatron) or drop the flag'),
    "log_gpt": (REFUSED, REFUSED,
        "Megatron computes it for one model replicated over its data-parallel group, not for a rank's slices; "
        "the progress line has each task's loss, the step's TFLOP/s and MFU and the global gradient norm"),
    "impl": (HONORED, HONORED,
        "the layers' implementation (default local in both loops; transformer_engine needs TransformerEngine "
        'and a GPU)'),
    "dataloader": (REFUSED, REFUSED,
        'Spindle feeds multi-task batches itself (--dataloader-type external)'),
    "mock": (HONORED, HONORED,
        "synthetic samples of every task's shapes, the default without --spindle-data (said once at start)"),
    "data": (REFUSED, REFUSED,
        "Megatron's GPT datasets feed one text model; a Spindle model reads one megatron-energon dataset per "
        'task: --spindle-data DIR (docs/data.md)'),
    "tokenizer": (REFUSED, REFUSED,
        'a Spindle model takes token ids from its data (--spindle-data, one energon dataset per task) and its '
        "vocabulary from --spindle-model's spec"),
    "geometry": (REFUSED, REFUSED,
        "the model's geometry is --spindle-model's (its spec and --spindle-size; docs/models.md)"),
    "tp": (MAPPED, MAPPED,
        "every slice's tensor-parallel degree is at least this where a MetaOp splits that many ways within an "
        "NVLink island (the planner keeps it as a constraint; Megatron's global TP stays 1); a --spindle-plan "
        'made otherwise is refused'),
    "zero1": (REFUSED, MAPPED,
        "ZeRO-1 in every slice of the built-in loop (the plan's distributed optimizer shards each weight's "
        "optimizer state over the ranks that hold it); Megatron-LM's loop steps whole parameters under the "
        "hooks: use the built-in loop there (SPINDLE_BACKEND=loop)"),
    "overlap_grad": (HONORED, HONORED,
        "Spindle always posts each gradient bucket's reduce as soon as the bucket is complete, overlapping "
        'the backward pass'),
    "bucket": (HONORED, HONORED,
        "the size of each rank set's gradient buckets"),
    "param_gather": (REFUSED, REFUSED,
        'Spindle gathers the updated optimizer shards before the next forward, not overlapped with it'),
    "pp": (REFUSED, REFUSED,
        "Spindle runs each MetaOp's slice with its own tensor- and data-parallel degrees; pipeline, context "
        "and expert parallelism inside a slice are not supported (the plan's waves pipeline the MetaOps)"),
    "sp": (REFUSED, REFUSED,
        "Spindle's tensor-parallel slices keep the whole sequence on every rank of the slice (no sequence "
        'parallelism)'),
    "fsdp": (REFUSED, REFUSED,
        "needs Megatron's DDP or FSDP buffers over one data-parallel group; Spindle synchronises gradients "
        'per parameter group (ZeRO-1 with --use-distributed-optimizer in the built-in loop)'),
    "recompute": (MAPPED, MAPPED,
        'full: every layer of every MetaOp that can recompute (transformer and decoder layers) is '
        "checkpointed (uniform, one layer per checkpoint); selective: megatron.core's selective recompute of "
        'the layer norms and the MLP inside those layers; the planner keeps it as a constraint'),
    "recompute_opt": (REFUSED, REFUSED,
        "Spindle's full recompute checkpoints each layer (--recompute-method uniform --recompute-num-layers "
        '1) and its selective recompute runs the layer norms and the MLP again (--recompute-modules layernorm '
        'mlp)'),
    "rampup": (REFUSED, REFUSED,
        "the plan's passes per step are fixed for the run: give --global-batch-size (replan with "
        '--spindle-task-schedule in the built-in loop)'),
    "megatron_model": (REFUSED, REFUSED,
        "configures Megatron's own model (GPT, MoE, Mamba, MLA, fp8/fp4, multi-token prediction, ...), which "
        "a --spindle run does not build: the model is --spindle-model's"),
    "kernels": (REFUSED, REFUSED,
        "a kernel, fusion, offload or overlap feature of Megatron's own model; Spindle's layers are "
        "megatron.core's layer specs as --transformer-impl chooses, with their defaults"),
    "other_job": (REFUSED, REFUSED,
        'another kind of job (inference, RL, retrieval, vision pretraining, distillation, SFT): use '
        'Megatron-LM without --spindle'),
    "resilience": (REFUSED, REFUSED,
        "a fault-tolerance, restart or diagnosis service of Megatron-LM not tried with Spindle's per-slice "
        "process groups; Spindle's own: --spindle-timeout, torchrun --max-restarts with --save "
        '(docs/failures.md)'),
    "runtime_mlm": (HONORED, REFUSED,
        "Megatron-LM's loop does this itself around the hooks; the built-in loop does not: run Megatron-LM's "
        'loop (SPINDLE_BACKEND=megatron) or drop the flag'),
    "launcher": (NO_EFFECT, NO_EFFECT,
        "torchrun's (LOCAL_RANK in the environment); nothing for the flag to change"),
    "mcore": (NO_EFFECT, NO_EFFECT,
        "Spindle's layers are megatron.core's already: the flag asks for what every Spindle run does"),
    "one_logger": (HONORED, NO_EFFECT,
        "turns Megatron-LM's one-logger telemetry off in its loop; the built-in loop has none to turn off"),
    "workers": (NO_EFFECT, NO_EFFECT,
        "Spindle's data comes from its own iterators (--dataloader-type external): there is no DataLoader to "
        'give workers'),
    "freeze": (REFUSED, REFUSED,
        'freeze modules with --spindle-freeze MODULE[,MODULE] (e.g. vision: no gradient, sync or optimizer '
        'state)'),
    "eval_batch": (REFUSED, REFUSED,
        "evaluation runs the plan's passes at the training batch (--micro-batch-size); validation data comes "
        "from the run's own iterators"),
    "comm": (REFUSED, REFUSED,
        "a setting of Megatron's process groups or collectives; Spindle creates each slice's groups itself, "
        'NCCL on GPUs and gloo on CPUs'),
    "yaml": (REFUSED, REFUSED,
        'Spindle reads its configuration from the command line: pass the flags themselves'),
    "rerun": (REFUSED, REFUSED,
        "Megatron's rerun state machine re-runs one model's step; a Spindle step's NaN check is "
        '--spindle-nonfinite-skips'),
}
