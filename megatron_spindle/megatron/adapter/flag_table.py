"""Every flag of Megatron-LM's argument parser under one rule of :mod:`.flag_contract` (which says what
each rule does in either loop, checks a command line against them and writes the table of
``docs/megatron.md``).

:data:`TABLE` lists every option string of ``megatron.training.arguments`` (megatron-core
0.19.2) under one rule, plus the flags of Megatron-LM's example scripts a user brings along (``--freeze-ViT``);
``--flag=a|b`` means that values ``a`` and ``b`` are accepted where the rule refuses (the default, given
explicitly) or are the values the mapping knows. ``tests/test_flag_contract.py`` walks the installed parser
and fails on any flag missing here, so a new Megatron-LM release's flags get classified.

Pure data: no import.
"""
TABLE: tuple[tuple[str, str], ...] = (  # (rule, its flags)
    ("batch", "--micro-batch-size --global-batch-size"),
    ("length", "--train-iters --train-samples"),
    ("lr", "--lr-decay-style --lr-wsd-decay-style --lr-decay-iters --lr-decay-samples --lr-wsd-decay-iters "
        "--lr-wsd-decay-samples --lr-warmup-fraction --lr-warmup-iters --lr-warmup-samples --lr-warmup-init "
        "--lr --min-lr"),
    ("lr_mlm", "--apply-wd-to-qk-layernorm --no-weight-decay-cond-type "
        "--override-opt_param-scheduler --override-opt-param-scheduler "
        "--use-checkpoint-opt_param-scheduler --use-checkpoint-opt-param-scheduler --decoupled-lr --decoupled-min-lr"),
    ("optim", "--weight-decay --start-weight-decay --end-weight-decay --weight-decay-incr-style --clip-grad "
        "--adam-beta1 --adam-beta2 --adam-eps"),
    ("optimizer", "--sgd-momentum --muon-momentum --muon-no-split-qkv --muon-nesterov --muon-scale-mode "
        "--muon-fp32-matmul-prec --muon-coefficient-type --muon-num-ns-steps --muon-tp-mode "
        "--muon-extra-scale-factor --muon-scalar-optimizer --lion-beta1 --lion-beta2 "
        "--optimizer=adam"),
    ("seed", "--seed"),
    ("layers", "--hidden-dropout --attention-dropout --init-method-std"),
    ("per_token", "--calculate-per-token-loss"),
    ("eval", "--eval-iters --eval-interval"),
    ("exit", "--exit-interval --exit-signal-handler"),
    ("exit_mlm", "--exit-duration-in-mins --exit-signal --exit-signal-handler-for-dataloader "
        "--exit-signal-handler-for-training"),
    ("bf16", "--bf16"),
    ("fp16", "--fp16"),
    ("fp32_grads", "--accumulate-allreduce-grads-in-fp32"),
    ("loss_scale", "--loss-scale --initial-loss-scale --min-loss-scale --loss-scale-window --hysteresis"),
    ("ckpt", "--save --save-interval --persistent-save-interval --load --ckpt-format=torch_dist"),
    ("ckpt_mlm", "--save-retain-interval --load-main-params-from-ckpt --finetune --ckpt-step "
        "--use-checkpoint-args --use-mp-args-from-checkpoint-args "
        "--no-use-tokenizer-model-from-checkpoint-args "
        "--disable-use-tokenizer-model-from-checkpoint-args --exit-on-missing-checkpoint "
        "--auto-detect-ckpt-format --no-ckpt-fully-parallel-save --async-save --async-strategy "
        "--use-persistent-ckpt-worker --async-ckpt-cpu-priority --async-ckpt-io-priority "
        "--async-ckpt-use-cpu-shm --ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo "
        "--ckpt-fully-parallel-save-process-group --ckpt-fully-parallel-load-process-group "
        "--ckpt-assume-constant-structure --no-ckpt-load-validate-sharding-integrity "
        "--disable-ckpt-load-validate-sharding-integrity --dist-ckpt-strictness "
        "--dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient "
        "--verify-integrity --no-stream-ckpt-dequant --disable-stream-ckpt-dequant --no-save-optim "
        "--no-save-rng --no-load-optim --no-load-rng --override-ckpt-iteration --dist-ckpt-workers "
        "--ckpt-fully-parallel-save"),
    ("ckpt_other", "--save-params-interval --save-activations-interval --save-tokens-per-expert-interval "
        "--save-wgrads-interval --save-dgrads-interval --non-persistent-save-interval "
        "--non-persistent-ckpt-type --non-persistent-global-ckpt-dir "
        "--non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo --pretrained-checkpoint "
        "--ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format "
        "--no-strict-fsdp-dtensor-load --disable-strict-fsdp-dtensor-load "
        "--dist-ckpt-save-pre-mcore-014 --replication --replication-jump --replication-factor "
        "--use-dist-ckpt --dist-ckpt-format"),
    ("log", "--log-interval --tensorboard-dir --tensorboard-log-interval --wandb-project --wandb-exp-name "
        "--wandb-save-dir"),
    ("log_mlm", "--log-progress --timing-log-level --timing-log-option --tensorboard-queue-size "
        "--log-timers-to-tensorboard --no-log-loss-scale-to-tensorboard "
        "--disable-log-loss-scale-to-tensorboard --log-validation-ppl-to-tensorboard "
        "--log-memory-to-tensorboard --log-memory-interval --log-device-memory-used "
        "--no-barrier-with-level-1-timing --log-world-size-to-tensorboard --wandb-entity "
        "--logging-level --log-energy"),
    ("log_gpt", "--log-params-norm --log-throughput --log-num-zeros-in-grad --log-max-attention-logit"),
    ("impl", "--transformer-impl"),
    ("dataloader", "--dataloader-type=external"),
    ("mock", "--mock-data"),
    ("data", "--multiple-validation-sets --validation-set-names --data-path --phase-transition-iterations "
        "--split --train-data-path --valid-data-path --test-data-path --data-args-path "
        "--per-split-data-args-path --per-dataset-sequences-path --dataloader-fast-cache-load "
        "--dataloader-defer-npy-index-mmap --data-cache-path --no-mmap-bin-files --sample-rate "
        "--mask-prob --short-seq-prob --reset-position-ids --reset-attention-mask "
        "--dataloader-inter-document-masking --eod-mask-loss --no-create-attention-mask-in-dataloader "
        "--num-dataset-builder-threads --object-storage-cache-path --mid-level-dataset-surplus "
        "--allow-ambiguous-pad-tokens --fim-data --fim-rate --fim-spm-rate --fim-split-sample "
        "--fim-fragment-rate --fim-no-prefix --fim-prefix-token --fim-middle-token --fim-suffix-token "
        "--fim-pad-token --fim-eod-token"),
    ("tokenizer", "--vocab-size --padded-vocab-size --no-pad-vocab-size --disable-pad-vocab-size --vocab-file "
        "--merge-file --vocab-extra-ids --tokenizer-type --tokenizer-model --tokenizer-metadata "
        "--tokenizer-special-tokens --tiktoken-pattern --tiktoken-num-special-tokens "
        "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast "
        "--tokenizer-hf-no-include-special-tokens --trust-remote-code --null-tokenizer-eod-id "
        "--null-tokenizer-pad-id --chat-template"),
    ("geometry", "--num-layers --hidden-size --num-attention-heads --num-query-groups --ffn-hidden-size "
        "--kv-channels --encoder-num-layers --decoder-num-layers --group-query-attention "
        "--window-size --window-attn-skip-freq --max-position-embeddings --position-embedding-type "
        "--yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow "
        "--yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int "
        "--relative-attention-num-buckets --relative-attention-max-distance "
        "--use-rotary-position-embeddings --rotary-base --rotary-percent "
        "--rotary-seq-len-interpolation-factor --use-rope-scaling --rope-scaling-factor "
        "--no-rope-freq --no-position-embedding --make-vocab-size-divisible-by --openai-gelu "
        "--squared-relu --swiglu --quick-geglu --onnx-safe --bert-no-binary-head "
        "--untie-embeddings-and-output-weights --batch-size --init-method-xavier-uniform --seq-length "
        "--encoder-seq-length --decoder-seq-length"),
    ("tp", "--tensor-model-parallel-size"),
    ("zero1", "--use-distributed-optimizer"),
    ("overlap_grad", "--overlap-grad-reduce"),
    ("bucket", "--ddp-bucket-size"),
    ("param_gather", "--overlap-param-gather --overlap-param-gather-with-optimizer-step "
        "--no-align-param-gather"),
    ("pp", "--tensor-parallel-num-weight-shards --pipeline-model-parallel-comm-backend "
        "--pipeline-model-parallel-size=1 --context-parallel-size=1 --hierarchical-context-parallel-sizes "
        "--max-seqlen-per-dp-cp-rank --hybrid-context-parallel --expert-model-parallel-size=1 "
        "--expert-tensor-parallel-size --expert-tensor-parallel-num-weight-shards --use-ring-exchange-p2p "
        "--overlap-p2p-communication-warmup-flush --microbatch-group-size-per-virtual-pipeline-stage "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
        "--data-parallel-random-init --use-tp-pp-dp-mapping --decoder-first-pipeline-num-layers "
        "--decoder-last-pipeline-num-layers --pipeline-model-parallel-layout --model-parallel-size "
        "--num-layers-per-virtual-pipeline-stage --num-virtual-stages-per-pipeline-rank "
        "--no-overlap-p2p-communication --cp-comm-type"),
    ("sp", "--sequence-parallel"),
    ("fsdp", "--no-align-grad-reduce --disable-align-grad-reduce --use-megatron-fsdp --use-torch-fsdp2 "
        "--ddp-num-buckets --ddp-pad-buckets-for-high-nccl-busbw "
        "--ddp-reduce-scatter-with-fp32-accumulation "
        "--ddp-param-name-patterns-for-fp32-local-accumulation --ddp-average-in-collective "
        "--no-use-layer-wise-param-layout --fsdp-manual-registration --create-all-gather-group "
        "--data-parallel-sharding-strategy --outer-dp-sharding-strategy --no-gradient-reduce-div-fusion "
        "--fsdp-double-buffer --suggested-communication-unit-size --keep-fp8-transpose-cache "
        "--enable-full-sharding-in-hsdp --num-distributed-optimizer-instances "
        "--torch-fsdp2-no-reshard-after-forward"),
    ("recompute", "--recompute-granularity=full|selective --recompute-activations"),
    ("recompute_opt", "--recompute-method=uniform --recompute-num-layers=1 --distribute-saved-activations "
        "--recompute-modules=layernorm|mlp --moe-layer-recompute --checkpoint-activations"),
    ("rampup", "--rampup-batch-size --step-batch-size-schedule --decrease-batch-size-if-needed"),
    ("megatron_model", "--no-initialization --use-cpu-initialization --deterministic-mode --tp-comm-overlap "
        "--no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad "
        "--disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag "
        "--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad "
        "--no-tp-comm-split-ag --disable-tp-comm-split-ag --no-tp-comm-split-rs "
        "--disable-tp-comm-split-rs --cross-entropy-loss-fusion --cross-entropy-fusion-impl "
        "--overlap-moe-expert-parallel-comm --delay-wgrad-compute "
        "--overlap-dispatch-backward-with-experts-wgrad --ep-overlap-early-attn-memory-release "
        "--defer-embedding-wgrad-compute --wgrad-deferral-limit --mtp-standalone "
        "--cpu-offloading-num-layers --cpu-offloading-retain-pinned-cpu-buffers "
        "--mtp-num-layers --mtp-loss-scaling-factor --mtp-use-repeated-layer --mtp-detach-heads "
        "--mtp-hybrid-override-pattern --attention-backend --flash-attention-version "
        "--softmax-type --fp32-residual-connection --apply-residual-connection-post-layernorm "
        "--norm-epsilon --apply-layernorm-1p --disable-bias-linear --add-qkv-bias "
        "--glu-linear-offset --activation-func-clamp-value --rotary-interleaved --normalization "
        "--qk-layernorm --qk-l2-norm --qk-clip --qk-clip-alpha --qk-clip-threshold "
        "--attention-output-gate --multi-latent-attention --experimental-attention-variant "
        "--dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk "
        "--dsa-indexer-topk-freq --dsa-indexer-skip-topk-offset --dsa-indexer-loss-coeff "
        "--dsa-indexer-use-sparse-loss --dsa-kernel-backend --dsa-indexer-rope-interleaved "
        "--no-dsa-indexer-rotate-activation --disable-dsa-indexer-rotate-activation "
        "--no-dsa-indexer-scoring-relu --disable-dsa-indexer-scoring-relu "
        "--dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --linear-conv-kernel-dim "
        "--linear-key-head-dim --linear-value-head-dim --linear-num-key-heads "
        "--linear-num-value-heads --embedding-init-method-std --init-model-with-meta-device "
        "--use-mup --mup-width-mult --mup-base-hidden-size --mup-embedding-mult "
        "--mup-output-mult --mup-base-head-dim --mup-attn-scale-power "
        "--apply-query-key-layer-scaling --disable-bf16-reduced-precision-matmul "
        "--use-fused-weighted-squared-relu --fused-residual-rmsnorm "
        "--use-transformer-engine-op-fuser --fp8-format --fp8-recipe --fp8-quantizer-factory "
        "--fp8-margin --fp8-interval --fp8-amax-history-len --fp8-amax-compute-algo "
        "--no-fp8-wgrad --disable-fp8-wgrad --fp8-output-proj --first-last-layers-bf16 "
        "--num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 --use-kitchen-attention "
        "--kitchen-attention-backend --fp4-format --fp4-recipe --fp4-quantizer-factory "
        "--high-priority-a2a-comm-stream --moe-shared-expert-intermediate-size "
        "--moe-shared-expert-gate --moe-shared-expert-overlap "
        "--use-grouped-gemm-for-shared-expert --moe-shared-expert-glu-interleave-size "
        "--moe-ffn-hidden-size --moe-router-topk --moe-enable-routing-replay "
        "--moe-router-padding-for-quantization --moe-router-padding-for-fp8 "
        "--moe-router-num-groups --moe-router-group-topk --moe-router-pre-softmax "
        "--moe-router-topk-scaling-factor --moe-router-score-function --moe-router-dtype "
        "--moe-router-enable-expert-bias --moe-router-bias-update-rate "
        "--moe-router-quantile-balancing-ema --moe-router-force-load-balancing "
        "--moe-router-force-biased --use-grouped-gemm-for-dense-mlp --moe-grouped-gemm "
        "--moe-single-grouped-weight --moe-single-grouped-bias --moe-z-loss-coeff "
        "--moe-input-jitter-eps --moe-token-dispatcher-type --moe-enable-deepep "
        "--moe-flex-dispatcher-backend --moe-permute-fusion-into-hybridep "
        "--moe-hybridep-pad-uneven-dispatch-inputs --moe-per-layer-logging "
        "--moe-expert-capacity-factor --moe-pad-expert-input-to-capacity "
        "--moe-pad-experts-for-cuda-graph-inference --moe-token-drop-policy "
        "--moe-permute-fusion --moe-router-fusion --moe-apply-probs-on-input --moe-latent-size "
        "--moe-flex-dispatcher-num-sms --moe-deepep-num-sms --moe-hybridep-num-sms "
        "--moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute "
        "--moe-hybridep-num-sms-preprocessing --moe-ncclep-static-shape --moe-ncclep-zero-copy "
        "--moe-mlp-glu-interleave-size --moe-expert-rank-capacity-factor --enable-cuda-graph "
        "--cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl "
        "--inference-cuda-graph-scope --no-clone-scatter-output-in-embedding "
        "--disable-clone-scatter-output-in-embedding --config-logger-dir --flash-decode "
        "--batch-invariant-mode --use-te-activation-func --nccl-all-reduce-for-prefill "
        "--inference-fuse-tp-communication --inference-disable-triton-nvls-kernels "
        "--inference-grouped-gemm-backend --inference-moe-disable-fused-quant-kernels "
        "--inference-moe-token-dispatcher-type --mrope-section --is-hybrid-model "
        "--mamba-state-dim --mamba-head-dim --mamba-num-groups --mamba-num-heads "
        "--disable-mamba-mem-eff-path --mlp-chunks-for-prefill --mlp-chunks-for-training "
        "--fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size "
        "--delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks "
        "--activation-offload-fraction --moe-paged-stash --moe-paged-stash-page-size "
        "--moe-paged-stash-buffer-size-factor-cuda --moe-paged-stash-buffer-size-factor-cpu "
        "--fine-grained-offloading-max-inflight-offloads --rope-type "
        "--warmup --freeze-all-layers --num-experts --moe-layer-freq --moe-use-upcycling "
        "--moe-router-load-balancing-type --moe-aux-loss-coeff --moe-upcycling-granularity "
        "--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim "
        "--rotary-scaling-factor --mscale --mscale-all-dim --cache-mla-latents "
        "--mla-down-proj-fusion --linear-attention-freq --heterogeneous-layers-config-path "
        "--heterogeneous-layers-config-encoded-json --moe-routing-trace-path "
        "--moe-routing-trace-max-training-iters --moe-routing-trace-capture-logits "
        "--moe-routing-trace-capture-hidden-states --moe-routing-trace-dump-weights "
        "--enable-experimental --spec --hybrid-layer-pattern --hybrid-override-pattern "
        "--use-precision-aware-optimizer --main-grads-dtype --main-params-dtype --exp-avg-dtype "
        "--exp-avg-sq-dtype --megatron-fsdp-main-params-dtype --megatron-fsdp-main-grads-dtype "
        "--megatron-fsdp-grad-comm-dtype --megatron-fsdp-enable-fine-grained-param-gather "
        "--megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail"),
    ("kernels", "--tp-comm-overlap-cfg --no-masked-softmax-fusion --no-bias-gelu-fusion "
        "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --use-flash-attn "
        "--optimizer-cpu-offload --optimizer-cuda-graph --optimizer-offload-fraction "
        "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d "
        "--dump-param-to-param-group-map --no-pin-cpu-grads --no-pin-cpu-params "
        "--no-persist-layer-norm --no-gradient-accumulation-fusion --te-rng-tracker "
        "--inference-rng-tracker --grad-reduce-in-bf16 --attention-softmax-in-fp32 "
        "--fp16-lm-cross-entropy --reuse-grad-buf-for-mxfp8-param-ag --mamba-training-ssm-states-dtype "
        "--disable-jit-fuser --fp4-param-gather --fp8-param-gather --te-precision-config-file"),
    ("other_job", "--perform-rl-step --rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size "
        "--rl-generation-lag --rl-submission-granularity --rl-consumption-granularity "
        "--grpo-iterations --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta "
        "--grpo-entropy-term-weight --grpo-filter-groups-with-same-reward --langrl-env-config "
        "--rl-default-temperature --rl-default-top-p --rl-default-top-k "
        "--rl-offload-optimizer-during-inference --rl-kv-cache-management-mode "
        "--rl-persist-cuda-graphs --no-rl-persist-cuda-graphs --rl-partial-rollouts "
        "--no-rl-partial-rollouts --rl-inference-logprobs-is-correction "
        "--no-rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef "
        "--rl-use-sequence-packing --no-rl-use-sequence-packing "
        "--rl-sequence-packing-max-sequences-per-bin --rl-sequence-packing-algo "
        "--rl-training-cuda-graphs --no-rl-training-cuda-graphs "
        "--rl-inference-tensor-model-parallel-size --rl-inference-pipeline-model-parallel-size "
        "--rl-inference-expert-model-parallel-size --rl-inference-expert-tensor-model-parallel-size "
        "--rl-inference-model-unified-memory-level --rl-offload-inference-model-weights-when-idle "
        "--no-rl-offload-inference-model-weights-when-idle --refit-method "
        "--rl-verify-model-weights-swap --no-rl-verify-model-weights-swap --rl-skip-bos-token "
        "--no-rl-skip-bos-token --rl-profile --rl-profile-dir --rl-inference-parsers --ict-head-size "
        "--biencoder-projection-dim --biencoder-shared-query-context-model --ict-load --bert-load "
        "--titles-data-path --query-in-block-prob --use-one-sent-docs --evidence-data-path "
        "--retriever-report-topk-accuracies --retriever-score-scaling --block-data-path "
        "--embedding-path --indexer-batch-size --indexer-log-interval --num-classes --img-h --img-w "
        "--num-channels --patch-dim --classes-fraction --data-per-class-fraction --no-data-sharding "
        "--head-lr-mult --vision-pretraining --vision-pretraining-type --vision-backbone-type "
        "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
        "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size "
        "--dino-freeze-last-layer --dino-norm-last-layer --dino-warmup-teacher-temp "
        "--dino-teacher-temp --dino-warmup-teacher-temp-epochs --logits-save-top-k "
        "--logits-save-top-p --logits-save-top-p-min-k --logits-save-dir --logits-save-dtype "
        "--logits-load-dir --logits-load-decode-threads --logits-load-prefetch-factor "
        "--logits-load-msc-prefetch-depth --logits-load-kd-loss-alpha --logits-load-ignore-errors "
        "--inference-batch-times-seqlen-threshold --max-tokens-to-oom --output-bert-embeddings "
        "--bert-embedder-type --cuda-graph-scope --cuda-graph-modules --use-legacy-static-engine "
        "--inference-max-requests --inference-max-seq-length --inference-dynamic-batching "
        "--inference-dynamic-batching-buffer-size-gb "
        "--inference-dynamic-batching-paused-buffer-size-gb "
        "--inference-dynamic-batching-mamba-memory-ratio --inference-dynamic-batching-block-size "
        "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
        "--inference-dynamic-batching-num-cuda-graphs "
        "--inference-dynamic-batching-track-paused-request-events "
        "--inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs "
        "--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens "
        "--inference-dynamic-batching-unified-memory-level --enable-chunked-prefill "
        "--num-speculative-tokens --inference-dynamic-batching-prefix-caching "
        "--no-inference-dynamic-batching-prefix-caching "
        "--inference-dynamic-batching-prefix-caching-eviction-policy "
        "--inference-dynamic-batching-prefix-caching-coordinator-policy "
        "--inference-dynamic-batching-prefix-caching-routing-alpha "
        "--inference-dynamic-batching-prefix-caching-mamba-gb "
        "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
        "--inference-dynamic-batching-cuda-graph-sizing-distribution "
        "--inference-dynamic-batching-sampling-backend --use-same-sampling-seed-across-dp-ranks "
        "--inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-logprobs-mode "
        "--inference-logging-step-interval --inference-text-gen-server-logging "
        "--no-inference-text-gen-server-logging --inference-wandb-logging "
        "--no-inference-wandb-logging --inference-coordinator-port "
        "--mamba-inference-conv-states-dtype --mamba-inference-ssm-states-dtype "
        "--inference-use-synchronous-zmq-collectives --no-inference-use-synchronous-zmq-collectives "
        "--inference-disable-ep-consensus --no-inference-disable-ep-consensus --inference-shards "
        "--sft --sft-tokenizer-prompt-format"),
    ("resilience", "--check-weight-hash-across-dp-replicas-interval --gpu-sniff-test-interval "
        "--adlr-autoresume --adlr-autoresume-interval --log-straggler --straggler-ctrlr-port "
        "--straggler-minmax-count --disable-straggler-on-startup --run-workload-inspector-server "
        "--one-logger-project --one-logger-run-name --one-logger-async --app-tag-run-name "
        "--app-tag-run-version --inprocess-restart --inprocess-max-iterations "
        "--inprocess-monitor-thread-interval --inprocess-monitor-process-interval "
        "--inprocess-progress-watchdog-interval --inprocess-heartbeat-interval "
        "--inprocess-soft-timeout --inprocess-hard-timeout --inprocess-heartbeat-timeout "
        "--inprocess-barrier-timeout --inprocess-completion-timeout --inprocess-last-call-wait "
        "--inprocess-termination-grace-time --inprocess-granularity --inprocess-active-world-size "
        "--inprocess-empty-cuda-cache --enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters "
        "--enable-msc --disable-msc --fault-injector-ranks --fault-injector-num-ranks "
        "--fault-injector-fault-types --fault-injector-fault-probabilities "
        "--fault-injector-fault-delay --fault-injector-delay-start-iteration "
        "--fault-injector-mtti-seconds --fault-injector-offset-seconds --fault-injector-seed"),
    ("runtime_mlm", "--profile --profile-step-start --profile-step-end --use-pytorch-profiler "
        "--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack "
        "--pytorch-profiler-collect-chakra --profile-ranks --record-memory-history "
        "--memory-snapshot-path --record-shapes --nvtx-ranges --empty-unused-memory-level "
        "--train-sync-interval --manual-gc --manual-gc-interval --no-manual-gc-eval "
        "--disable-manual-gc-eval --iterations-to-skip --no-check-for-nan-in-loss-and-grad "
        "--check-for-large-grads --distributed-backend=nccl|gloo --distributed-timeout-minutes "
        "--distributed-timeout-seconds-after-init --flight-recorder-dump-path "
        "--flight-recorder-trace-buffer-size --no-flight-recorder-dump-on-timeout "
        "--disable-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace "
        "--no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active "
        "--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec "
        "--start-eval-at-iter --skip-train --test-mode --full-validation"),
    ("launcher", "--local-rank"),
    ("mcore", "--use-mcore-models"),
    ("one_logger", "--no-one-logger"),
    ("workers", "--num-workers"),
    ("freeze", "--freeze-ViT --freeze-LM"),
    ("eval_batch", "--eval-global-batch-size --eval-micro-batch-size"),
    ("comm", "--tp-comm-bootstrap-backend --symmetric-ar-type --lazy-mpu-init --nccl-communicator-config-path "
        "--disable-gloo-process-groups --use-sharp --sharp-enabled-group --high-priority-stream-groups "
        "--use-nccl-ub --disable-symmetric-registration --fake-process-group"),
    ("yaml", "--yaml-cfg"),
    ("rerun", "--result-rejected-tracker-filename --error-injection-rate --error-injection-type "
        "--rerun-mode=validate_results --check-for-spiky-loss"),
)
