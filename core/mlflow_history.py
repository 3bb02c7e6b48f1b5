"""Metric histories of MLflow runs, for resuming: cut a run back to a step, copy one run into another.

MLflow keeps every value logged for a (metric, step) pair and has no API to remove one
(mlflow/mlflow#2973, open since 2020). A resumed core run logs again the steps that follow its
checkpoint, so the values the stopped process logged for those steps must go, or the run would
hold two values for each of them:

- SQL tracking stores (``sqlite:`` — MLflow's default and ours —, ``postgresql:``, ``mysql:``,
  ``mssql:``): ``rewind`` deletes them in one transaction through MLflow's own table models and
  recomputes the run's latest values (what the MLflow UI shows as the run's metrics).
- Other stores (an HTTP tracking server, Databricks) cannot delete: ``rewind`` returns None and
  the old values stay. Every reader then keeps, for each step, the value logged last
  (``one_per_step``): the resumed process logs after the stopped one, so its values win.

``copy_history`` gives a new run the history of the run it continues, up to the checkpoint's step,
for when the original run cannot be reopened (another tracking store, a deleted run).

This module does not decide when to rewind or copy (``core.run.telemetry`` does), and it touches
only metric values: params, tags and artifacts stay as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from mlflow.entities import Metric
from mlflow.store.db.db_types import DATABASE_ENGINES, SQLITE
from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_METRICS_PER_BATCH
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)


def _scheme(tracking_uri: str) -> str:
    # "postgresql+psycopg2://..." names the driver after the "+"; the database kind comes first.
    return urlparse(tracking_uri).scheme.split("+", 1)[0]


def is_sql_store(tracking_uri: str) -> bool:
    return _scheme(tracking_uri) in DATABASE_ENGINES


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores and in-memory databases)."""
    if _scheme(tracking_uri) != SQLITE:
        return None
    path = tracking_uri.split(":///", 1)[1] if ":///" in tracking_uri else ""
    return Path(path.split("?", 1)[0]) if path and path != ":memory:" else None


def canonical_uri(tracking_uri: str) -> str:
    """The URI with a relative sqlite path made absolute, so a store is named the same from any folder.

    ``sqlite:///mlflow.db`` means a different file in each working folder; a checkpoint records the
    absolute form, so a resume started elsewhere sees that it logs to another store.
    """
    path = sqlite_path(tracking_uri)
    if path is None or path.is_absolute():
        return tracking_uri
    query = "?" + tracking_uri.split("?", 1)[1] if "?" in tracking_uri else ""
    return f"{SQLITE}:///{path.resolve()}{query}"


def store_exists(tracking_uri: str) -> bool:
    """False for a sqlite file that is gone: opening one would create an empty store there."""
    path = sqlite_path(tracking_uri)
    return path is None or path.is_file()


def rewind(tracking_uri: str, run_id: str, after_step: int) -> int | None:
    """Delete every metric value of `run_id` logged for a step after `after_step`.

    Returns how many values were removed, or None when the store offers no way to remove any.
    """
    if not is_sql_store(tracking_uri):
        return None
    engine = create_engine(tracking_uri)
    try:
        with Session(engine) as session, session.begin():
            removed = (
                session.query(SqlMetric)
                .filter(SqlMetric.run_uuid == run_id, SqlMetric.step > after_step)
                .delete(synchronize_session=False)
            )
            stale = (
                session.query(SqlLatestMetric)
                .filter(SqlLatestMetric.run_uuid == run_id, SqlLatestMetric.step > after_step)
                .all()
            )
            for latest in stale:
                # MLflow's own rule for a run's latest value: the largest (step, timestamp, value).
                newest = (
                    session.query(SqlMetric)
                    .filter(SqlMetric.run_uuid == run_id, SqlMetric.key == latest.key)
                    .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(), SqlMetric.value.desc())
                    .first()
                )
                if newest is None:
                    session.delete(latest)
                else:
                    latest.step, latest.timestamp = newest.step, newest.timestamp
                    latest.value, latest.is_nan = newest.value, newest.is_nan
    finally:
        engine.dispose()
    return removed


def one_per_step(history: Iterable[Metric]) -> list[Metric]:
    """A metric's history with one value per step, the one logged last; sorted by step."""
    last: dict[int, Metric] = {}
    for m in history:
        kept = last.get(m.step)
        if kept is None or m.timestamp >= kept.timestamp:
            last[m.step] = m
    return [last[step] for step in sorted(last)]


def copy_history(source: MlflowClient, source_run: str, target: MlflowClient, target_run: str, upto_step: int) -> int:
    """Log into `target_run` every metric of `source_run` up to `upto_step` (one value per step).

    Returns how many values were copied. Raises MlflowException when the source cannot be read.
    """
    keys = sorted(source.get_run(source_run).data.metrics)
    copied = [
        Metric(m.key, m.value, m.timestamp, m.step)
        for key in keys
        for m in one_per_step(source.get_metric_history(source_run, key))
        if m.step <= upto_step
    ]
    for start in range(0, len(copied), MAX_METRICS_PER_BATCH):
        target.log_batch(target_run, metrics=copied[start : start + MAX_METRICS_PER_BATCH])
    log.info("copied %d metric values (steps up to %d) from MLflow run %s", len(copied), upto_step, source_run)
    return len(copied)
