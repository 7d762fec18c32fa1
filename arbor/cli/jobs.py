"""The job subcommands: ``arbor NAME [cfg.toml] [key=value …]`` (sft, train, eval, demo, dllm-train,
dllm-distill); each loads its config dataclass and calls the library."""

from __future__ import annotations

from arbor.cli.common import job_parser, split_config


def add_sft(sub) -> None:
    p = job_parser(sub, "sft", "warm-start a model on a task's demonstrations (next-token SFT)",
                    "arbor.train.sft:SFTRunConfig")

    def run(a):
        from arbor import configs
        from arbor.train.sft import SFTRunConfig, run_sft
        path, over = split_config(a)
        cfg = configs.load(SFTRunConfig, path, over)
        run_sft(cfg)
        print(f"saved {cfg.out}")

    p.set_defaults(func=run)


def add_train(sub) -> None:
    p = job_parser(sub, "train", "RL on a task: rollout trees, GRPO/PPO with IcePop or TIS, C3PO++; "
                    "cluster=ray runs it on Ray (engine replicas and trainer ranks as actors)",
                    "arbor.cluster.config:ClusterRLConfig")

    def run(a):
        from arbor import families
        from arbor.cluster.config import load_train_config
        from pathlib import Path
        path, over = split_config(a)
        cfg = load_train_config(path, over)
        families.train(cfg)
        final = Path(cfg.out) / "final" / "model"
        if final.is_dir():
            kind = ("a LoRA adapter over its base; `arbor export --merge` writes a plain HF folder"
                    if (final / "adapter_config.json").is_file() else "an HF folder")
            print(f"saved {final} ({kind}; arbor eval / generate / serve take it)")

    p.set_defaults(func=run)


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="held-out metrics of a model folder: a task's test split, or your data.eval rows "
                                    "with reward.fns (greedy; eval.samples=k for pass@k)")
    p.add_argument("model")
    p.add_argument("overrides", nargs="*", help="RL config keys, e.g. data.eval=test.jsonl 'reward.fns=[\"math\"]' "
                                                "eval.samples=4")
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--device", default="cpu")

    def run(a):
        from arbor import families
        metrics = families.evaluate(a.model, a.task, a.n, a.device, a.overrides)
        what = "data.eval" if any(o.startswith("data.eval=") for o in a.overrides) else a.task
        shown = "  ".join(f"{k} {v:.1%}" if k == "test_accuracy" or k.startswith("pass@") else f"{k} {v:.3g}"
                          for k, v in metrics.items())
        print(f"{what}: {shown} on up to {a.n} held-out rows")

    p.set_defaults(func=run, trailing_words="overrides")


def add_demo(sub) -> None:
    p = job_parser(sub, "demo", "the main job on the built-in task: SFT a tiny model, then RL",
                    "arbor.train.demo:DemoConfig")

    def run(a):
        from arbor import configs
        from arbor.train.demo import DemoConfig, demo
        path, over = split_config(a)
        demo(configs.load(DemoConfig, path, over))

    p.set_defaults(func=run)


def add_dllm_train(sub) -> None:
    p = job_parser(sub, "dllm-train", "masked-diffusion SFT of a tiny block-diffusion model on built-in tasks",
                    "arbor.dllm.sft:DiffusionTrainConfig")

    def run(a):
        from arbor import configs
        from arbor.dllm.sft import DiffusionTrainConfig, train_from_config
        path, over = split_config(a)
        cfg = configs.load(DiffusionTrainConfig, path, over)
        train_from_config(cfg)
        print(f"saved {cfg.out}")

    p.set_defaults(func=run)


def add_dllm_distill(sub) -> None:
    p = job_parser(sub, "dllm-distill", "TAD trajectory self-distillation → Quality and Speed students",
                    "arbor.dllm.tad:DistillRunConfig")

    def run(a):
        from arbor import configs
        from arbor.dllm.tad import DistillRunConfig, distill_folder
        path, over = split_config(a)
        for mode, folder in distill_folder(configs.load(DistillRunConfig, path, over)).items():
            print(f"{mode}: saved {folder}")

    p.set_defaults(func=run)
