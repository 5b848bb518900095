"""Data that flows between worker groups."""

from workbench.data.batch import PAD_KEY, Batch
