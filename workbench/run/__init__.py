"""Headless runs: a typed run config (`config`), the runner (`runner`), what runs write (`logs`),
how failures are told apart (`faults`), and whole-run checkpoints (`checkpoint`).

    from workbench.run import load_config, Runner
    result = Runner(load_config("configs/ppo.yaml", ["iterations=5"])).run()
"""

from workbench.run.config import RunConfig, load_config

__all__ = ["RunConfig", "Runner", "RunResult", "load_config", "run"]


def __getattr__(name: str):
    if name in ("Runner", "RunResult", "run"):  # the runner pulls in the model stack: on first use
        from workbench.run import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'workbench.run' has no attribute {name!r}")
