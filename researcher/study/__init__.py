"""The study: the LangGraph graph, its nodes, the runner that drives it, and its home on disk.

graph: the nodes and their edges · nodes/: one module per job · runner: start, resume and drive a
study · store: the study's folder, meta and lock · snapshot: LangGraph state read without the graph ·
archive: moving a study aside · inbox: proposals a person filed for the study to take.
Imports: runs, review, code, evidence and planner below it, and the foundation (records, brief,
budget, lazy). Only `cli` imports it.
"""
