"""When a forward computes each prompt once for the rows that repeat it: the rule the engines
run (workbench.engines.forward) and the planner prices (workbench.planner.specs), in one place."""

SHARE_MIN_PARAM_TOKENS = 2e10
"""Auto sharing needs saved prompt tokens x parameters at least this (~150 tokens of a 135M
model). Below it the second model call and the cache copy cost more than the prompt columns saved:
tiny-10m with 8-token prompts, 2 samples each, scored 12-17% slower shared (bench/plan_runs.py);
SmolLM2-135M with 46-token prompts, 4 samples each, trains 1.7x faster shared."""
