"""A real `mlflow server --app-name basic-auth` for the tests, with the accounts a shared machine would have.

The server (bench/soak_procs.py `MlflowServer`, started with MLflow's basic-auth app) keeps its users in a
SQLite database of its own; its admin, made at first start from the config file, creates the study's
account and a reviewer's, and gives the reviewer EDIT on the study's experiment once the study made it.
No account but the admin's may do anything by default (`default_permission = NO_PERMISSIONS`), so a
process without credentials gets 401 and one with another account 403. docs/security.md describes the
same set-up for people. A test helper: it starts and stops a server, and checks nothing itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.soak_procs import MlflowServer

ADMIN = ("admin", "admin-pass-1234")
STUDY = ("study-runner", "study-pass-5678")  # the study's own account: MLFLOW_TRACKING_USERNAME/PASSWORD
REVIEWER = ("alice", "alice-pass-9012")  # a person who reviews in the UI
AUTH_INI = """[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///{db}
admin_username = {admin}
admin_password = {password}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
"""
START_TIMEOUT_S = 300  # the auth app's start runs two sets of migrations: over a minute on a loaded 2-core host


@dataclass
class AuthServer:
    server: MlflowServer

    @property
    def uri(self) -> str:
        return self.server.uri

    def _admin(self, method: str, route: str, body: dict, version: str = "2.0",
               params: dict[str, str] | None = None) -> httpx.Response:
        done = httpx.request(method, f"{self.uri}/api/{version}/mlflow/{route}", json=body or None, params=params,
                             auth=ADMIN, timeout=30)
        done.raise_for_status()
        return done

    def grant(self, experiment_id: str, user: str, permission: str = "EDIT") -> None:
        """Give `user` `permission` on the experiment (as the admin, the way a person would)."""
        self._admin("POST", "users/permissions/grant", {"username": user, "resource_type": "experiment",
                                                        "resource_id": experiment_id, "permission": permission},
                    version="3.0")

    def experiment_id(self, name: str) -> str:
        return self._admin("GET", "experiments/get-by-name", {}, params={"experiment_name": name}).json()["experiment"]["experiment_id"]

    def study_env(self) -> dict[str, str]:
        """The credentials of the study's account, for the study's environment only."""
        return {"MLFLOW_TRACKING_USERNAME": STUDY[0], "MLFLOW_TRACKING_PASSWORD": STUDY[1]}

    def stop(self) -> None:
        self.server.stop()


def start_auth_server(mlflow: Path, folder: Path) -> AuthServer:
    """Start a basic-auth MLflow server in `folder`, with the study's and the reviewer's accounts made."""
    folder.mkdir(parents=True, exist_ok=True)
    ini = folder / "basic_auth.ini"
    ini.write_text(AUTH_INI.format(db=folder / "auth.db", admin=ADMIN[0], password=ADMIN[1]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_FLASK_SERVER_SECRET_KEY="tests-only-secret")
    server = MlflowServer(mlflow, folder, env)
    server.argv += ["--app-name", "basic-auth"]
    server.start(timeout_s=START_TIMEOUT_S)
    auth = AuthServer(server)
    for user, password in (STUDY, REVIEWER):
        auth._admin("POST", "users/create", {"username": user, "password": password})
    return auth
