"""`tandem operator`: run the kopf operator, or print/write the generated CRD and dashboards."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.operator.render import Defaults

    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--router-image", default=Defaults.router_image,
                        help="router image for InferenceServices that name none")
    parser.add_argument("--cluster-domain", default=Defaults.cluster_domain,
                        help="the cluster's DNS domain (pod names in the router's worker manifest)")
    parser.add_argument("--liveness-port", type=int, default=8080, help="kopf's /healthz port (0: off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--peering", default=None,
                        help="kopf peering name for several operator replicas (default: standalone, one replica)")
    sub = parser.add_subparsers(dest="operator_command")
    crd = sub.add_parser("crd", help="print the InferenceService CRD generated from the typed spec")
    crd.add_argument("--write", action="store_true", help="write crds/ and the chart's copy instead of printing")
    dash = sub.add_parser("dashboards", help="print the Grafana dashboards the chart ships (JSON by file name)")
    dash.add_argument("--write", action="store_true", help="write charts/tandem/dashboards/ instead of printing")


def main(args: argparse.Namespace) -> int:
    if args.operator_command == "crd":
        from tandem.operator import crd

        if args.write:
            for path in crd.write():
                print(f"wrote {path}")
        else:
            sys.stdout.write(crd.crd_yaml())
        return 0
    if args.operator_command == "dashboards":
        from tandem.operator import dashboards

        if args.write:
            for path in dashboards.write():
                print(f"wrote {path}")
        else:
            sys.stdout.write(json.dumps(dashboards.dashboards(), indent=2, sort_keys=True) + "\n")
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    import kopf
    import kubernetes
    from prometheus_client import start_http_server

    from tandem.operator import handlers
    from tandem.operator.render import Defaults

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers.configure(Defaults(router_image=args.router_image, cluster_domain=args.cluster_domain))
    # The handlers' own API client: in a pod the service account, elsewhere $KUBECONFIG.
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    if args.metrics_port:
        start_http_server(args.metrics_port)
    kopf.run(
        standalone=args.peering is None,
        peering_name=args.peering,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None,
    )
    return 0
