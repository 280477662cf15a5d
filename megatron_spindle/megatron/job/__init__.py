"""A job's launch checks and ending: ``lifeline`` (exit statuses, signals), ``preflight`` (the ranks'
agreement, the save lock), ``input_files`` (the files the flags name), ``gpu_node`` (the node's GPUs),
``launch_defaults`` (the training flags the launch scripts add)."""
