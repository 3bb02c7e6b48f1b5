"""What a person reads and decides on: the MLflow review surface, `show`, the console and the reports.

mlflow_review: proposals as MLflow runs, decisions read back · views: what `show`/`status` print ·
console: live rendering of a running study · report, report_html: the Markdown and HTML reports.
It decides nothing itself. Imports: evidence and the foundation.
"""
