"""The research brief: what a study optimises, spends, runs and may change.

`schema` holds the pydantic models (the brief's fields, their defaults and their checks); `loader`
turns a Markdown file with YAML front matter into a validated `Brief`, naming the line of any error.
Imports: only `core.config` and pydantic/yaml; nothing else in researcher/.
"""
