"""Evidence: reading run results from MLflow, scoring them over seeds, and the verdicts drawn from them.

analysis: metrics read back and scored per seed · decision: the decision rule (tests, Holm, the A/B
verdict, the recommendation) · baselines: which baseline a proposal is judged against ·
confirmation: the held-out-seed round · study_records, study_view: one typed view of a study's state,
validated once, that asks the others. It neither launches runs nor talks to a person.
Imports: only the foundation (records, brief, budget, lazy) and `core.mlflow_history`.
"""
