"""The study graph's nodes, one module per job, combined into the one object the graph binds.

base: state, context and helpers · planning: plan · code: workspace and validate ·
reviewing: review · running: prepare, launch, monitor · live: the live run and hot swaps ·
outcome: analyze, decide, report.
"""

from __future__ import annotations

from researcher.nodes.code import CodeNodes
from researcher.nodes.live import LiveNode
from researcher.nodes.outcome import OutcomeNodes
from researcher.nodes.planning import PlanNode
from researcher.nodes.reviewing import ReviewNode
from researcher.nodes.running import RunNodes


class StudyNodes(PlanNode, CodeNodes, ReviewNode, LiveNode, RunNodes, OutcomeNodes):
    """Every node of a study, bound to one StudyContext."""
