"""The Megatron layer, by concern.

* :mod:`.adapter`: what both loops share and Megatron-LM's ``pretrain`` calls: the flags (``flags``), the hooks
  (``hooks``, the only user of ``megatron.training``), the model chunk Megatron sees (``chunk``), the
  forward-backward contract (``schedule``), the run's graph, plan and model (``model``), data iterators
  (``data``), the equivalence check (``equivalence``);
* :mod:`.trainer`: the built-in megatron.core loop (``loop``), a run's start and end (``session``), the numeric
  guard (``guard``), TensorBoard / W&B (``logs``) and the live prediction (``prediction``);
* :mod:`.checkpoint`: distributed checkpoints (``save_load``), their files and manifest (``files``) and the
  save directory (``directory``, torch-free);
* :mod:`.job`: the launch checks: exit statuses and signals (``lifeline``), the ranks' agreement and the save
  lock (``preflight``), the files the flags name (``input_files``), the GPU node (``gpu_node``), the training flags the launch scripts
  add (``launch_defaults``).
"""
