"""`python -m hetmesh.gateway --cluster FILE [--host H] [--port P] [--instance ID]`.

`python -m hetmesh.gateway --hash-key` reads an API key on stdin and prints the SHA-256 that goes in
the cluster file's `[[auth.keys]]` (the key itself is never stored).
"""

from __future__ import annotations

import argparse
import sys

import uvicorn

from hetmesh import config
from hetmesh.runtime import setup_process

from .app import asgi_app
from .httpserver import uvicorn_http
from .service import Gateway, default_instance


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.gateway", description=__doc__)
    ap.add_argument("--cluster", help="cluster file (TOML); default $HETMESH_CLUSTER or ops/clusters/default.toml")
    ap.add_argument("--host", default=None, help="listen address (default: the cluster file's gateway.host)")
    ap.add_argument("--port", type=int, default=None, help="listen port (default: the cluster file's gateway.port)")
    ap.add_argument("--instance", default=None, help="instance id (names this gateway's reply subjects)")
    ap.add_argument("--hash-key", action="store_true", help="print the SHA-256 of the API key read on stdin")
    args = ap.parse_args()
    if args.hash_key:
        print(config.hash_key(sys.stdin.readline().strip()))
        return
    setup_process()
    cfg = config.load(args.cluster)
    if not cfg.mesh.nats_url:
        ap.error("no NATS URL: set mesh.nats_url in the cluster file or HETMESH_NATS_URL")
    host = args.host or cfg.gateway.host
    port = cfg.gateway.port if args.port is None else args.port
    gw = Gateway(cfg, args.instance or default_instance())
    # loop "auto": uvloop when installed; httptools when installed (both cut per-request overhead a lot), with
    # request heads limited in size (431) and slow clients timed out (408).
    uvicorn.run(asgi_app(gw), host=host, port=port, loop="auto", log_level="warning", access_log=False,
                timeout_graceful_shutdown=2, lifespan="on", **uvicorn_http(cfg.gateway))


if __name__ == "__main__":
    main()
