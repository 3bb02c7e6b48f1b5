"""Proposal code: the workspace a code proposal is applied in, and its validation.

workspace: a git worktree per proposal, edits applied and committed, read-only and editable areas
enforced · validation: apply, compile, contract, then (contained) import, tests and smoke.
It does not plan, review or launch training runs. Imports: only the foundation.
"""
