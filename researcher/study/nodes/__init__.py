"""The study graph's nodes, one module per job, combined into the one object the graph binds.

base: state, context and helpers · planning: plan · code: workspace and validate ·
reviewing: review · running: prepare, launch, monitor · live: the live run and hot swaps ·
outcome: analyze, decide, report.
"""

from __future__ import annotations

from researcher.study.nodes.code import CodeNodes
from researcher.study.nodes.live import LiveNode
from researcher.study.nodes.outcome import OutcomeNodes
from researcher.study.nodes.planning import PlanNode
from researcher.study.nodes.reviewing import ReviewNode
from researcher.study.nodes.running import RunNodes


class StudyNodes(PlanNode, CodeNodes, ReviewNode, LiveNode, RunNodes, OutcomeNodes):
    """Every node of a study, bound to one StudyContext."""
