"""megatron_patch's layers trained by stock DeepSpeed (0.19): for DeepSpeed users, and to check DeepSpeed plans.

A plan DeepSpeed's engine can run (:mod:`sailor_hpc.core.deepspeed_plan`: D replicas of one pipeline, TP 1,
one micro-batch size and count) is trained by DeepSpeed's ``PipelineModule``/``PipelineEngine`` (one
stage: its plain engine, which also runs ZeRO 2 and 3) over the same megatron-core modules, initialisation,
data order, loss and learning-rate schedule as megatron_patch, under the config of
:mod:`sailor_hpc.core.ds_config`. Checkpoints are megatron_patch's layout-free ones, so a run moves between
the runtimes (to a heterogeneous plan DeepSpeed cannot express, and back).

Modules: ``pipe`` (the stage as a DeepSpeed layer, the pipeline module), ``state`` (Adam's state by
canonical name under each ZeRO stage, the sample-based LR schedule), ``engine`` (one rank's trainer),
``launch`` (``python -m megatron_patch.ds_runtime.launch``, the arguments of ``megatron_patch.launch``).
"""
