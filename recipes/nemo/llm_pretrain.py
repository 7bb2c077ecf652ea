"""NeMo 2 LLM pre-training under ``resilient-run``, for GPU clusters (needs a NeMo container: PyPI's
``nemo-toolkit`` has no ``nemo.collections.llm``).

    # one node, 8 GPUs, through NeMo-Run's torchrun launcher (the torchrun shim starts resilient-run)
    python recipes/nemo/llm_pretrain.py --gpus 8 --ckpt-dir /mnt/localssd/nemo --resilient-args "--max-restarts 5"
    # Slurm: the same recipe, one resilient-run agent per node (srun ... resilient-run ... --no-python {{ command }})
    python recipes/nemo/llm_pretrain.py --slurm --nodes 4 --gpus 8 --account acct --partition batch ...

NeMo keeps its own distributed (Megatron) checkpoints here: tensor- and pipeline-parallel shards are its
format. ``resilient-run`` adds what NeMo lacks: in-job restarts of the crashed or hung ranks without
requeueing the allocation, hot spares, hang and straggler detection, and the goodput ledger;
``ResilientPreemption`` stops at one agreed step on a preemption notice on any device.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", help="a recipe module of nemo.collections.llm")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--ckpt-dir", default="/checkpoints/nemo")
    ap.add_argument("--resilient-args", default="--max-restarts 5", help="flags for resilient-run, one string")
    ap.add_argument("--slurm", action="store_true", help="submit with NeMo-Run's SlurmExecutor")
    ap.add_argument("--account", default=None)
    ap.add_argument("--partition", default=None)
    ap.add_argument("--container-image", default="nvcr.io/nvidia/nemo:25.07")
    ap.add_argument("--dry-run", action="store_true", help="build the recipe and executor, run nothing")
    args = ap.parse_args()
    try:
        from nemo.collections import llm  # first: without it, fail before anything heavy is imported
        import nemo_run as run
    except ImportError as e:
        print(f"llm_pretrain.py: cannot import nemo.collections.llm / nemo_run ({e}); run it in a NeMo container "
              "(nvcr.io/nvidia/nemo), PyPI's nemo-toolkit has no LLM collection", file=sys.stderr)
        return 2
    from resilient.integrations import nemo as rnemo
    from resilient.integrations.lightning import ResilientPreemption

    recipe_mod = getattr(llm, args.model, None)
    if recipe_mod is None or not hasattr(recipe_mod, "pretrain_recipe"):
        print(f"llm_pretrain.py: nemo.collections.llm has no recipe {args.model!r}; try llama3_8b, "
              "nemotron3_8b, mixtral_8x7b", file=sys.stderr)
        return 2
    recipe = recipe_mod.pretrain_recipe(name=f"{args.model}_resilient", dir=args.ckpt_dir, num_nodes=args.nodes,
                                        num_gpus_per_node=args.gpus)
    recipe.trainer.max_steps = args.max_steps
    recipe.trainer.callbacks = [*(recipe.trainer.callbacks or []), run.Config(ResilientPreemption)]
    if args.slurm:
        executor = run.SlurmExecutor(account=args.account, partition=args.partition, nodes=args.nodes,
                                     ntasks_per_node=1, gpus_per_node=args.gpus, container_image=args.container_image,
                                     launcher=rnemo.slurm_launcher(nproc_per_node=args.gpus,
                                                                   resilient_args=args.resilient_args))
    else:
        executor = rnemo.local_executor(ntasks_per_node=args.gpus, resilient_args=args.resilient_args)
    if args.dry_run:
        print(recipe, executor, sep="\n")
        return 0
    run.run(recipe, executor=executor, name=f"{args.model}_resilient")
    return 0


if __name__ == "__main__":  # NeMo-Run needs the guard
    sys.exit(main())
