"""Parallel-layout planner for the DeepSeek-V3 trainer (SimuMax-like): enumerate layouts, estimate memory and step
time analytically, rank them. See examples/deepseek_v3/plan.py."""
