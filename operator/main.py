"""`tandem operator`: run the kopf operator, print what it would create for a manifest (`render`),
or print/write the generated CRD and dashboards."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


def _add_defaults_arguments(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """The flags that set render.Defaults. `render` repeats them with suppressed defaults, so a
    value given before the subcommand (`tandem operator --router-image X render ...`) stands."""
    from tandem.operator.render import Defaults

    def default(value):
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--router-image", default=default(Defaults.router_image),
                        help="router image for InferenceServices that name none")
    parser.add_argument("--cluster-domain", default=default(Defaults.cluster_domain),
                        help="the cluster's DNS domain (pod names in the router's worker manifest)")
    parser.add_argument("--operator-namespace", default=default(Defaults.operator_namespace),
                        help="namespace of the operator's own pods, which the servers' NetworkPolicies admit to "
                             "their metrics port for the autoscaler (default: none, as outside the cluster)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable; default: all namespaces)")
    _add_defaults_arguments(parser)
    parser.add_argument("--liveness-port", type=int, default=8080, help="kopf's /healthz port (0: off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--peering", default=None,
                        help="kopf peering name for several operator replicas (default: standalone, one replica)")
    sub = parser.add_subparsers(dest="operator_command")
    render = sub.add_parser("render", help="print, as YAML, every object the operator would create for the "
                            "InferenceServices in a manifest; needs no cluster")
    render.add_argument("-f", "--filename", required=True,
                        help="InferenceService manifest, as for kubectl apply (- for stdin)")
    render.add_argument("-n", "--namespace", dest="render_namespace", default=None,
                        help="namespace of InferenceServices whose manifest names none (default: default)")
    _add_defaults_arguments(render, suppress=True)
    crd = sub.add_parser("crd", help="print the InferenceService CRD generated from the typed spec")
    crd.add_argument("--write", action="store_true", help="write crds/ and the chart's copy instead of printing")
    dash = sub.add_parser("dashboards", help="print the Grafana dashboards the chart ships (JSON by file name)")
    dash.add_argument("--write", action="store_true", help="write charts/tandem/dashboards/ instead of printing")


def main(args: argparse.Namespace) -> int:
    if args.operator_command == "render":
        return render_manifest(args)
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


def _defaults(args: argparse.Namespace):
    from tandem.operator.render import Defaults

    return Defaults(router_image=args.router_image, cluster_domain=args.cluster_domain,
                    operator_namespace=args.operator_namespace)


def render_manifest(args: argparse.Namespace) -> int:
    """`tandem operator render`: each InferenceService in the manifest parsed as the operator parses
    a live one (the same errors, naming the field), rendered as if the cluster served the
    monitoring CRDs, printed as multi-document YAML."""
    import yaml

    from tandem.operator.render import Instance, render_all, render_bootstrap_secret
    from tandem.operator.schema import SpecError
    from tandem.operator.spec import GROUP, KIND, VERSION, parse_spec

    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        print(f"error: {args.filename}: {e}", file=sys.stderr)
        return 2
    if not docs:
        print(f"error: {args.filename}: no {KIND} in it", file=sys.stderr)
        return 2
    defaults = _defaults(args)
    out = [f"# `tandem operator render` of {args.filename}: what the operator creates for it (operator flags: "
           f"--router-image {defaults.router_image} --cluster-domain {defaults.cluster_domain} "
           f"--operator-namespace {defaults.operator_namespace or '(none)'}).\n"
           f"# ownerReferences carry a placeholder uid, {PLACEHOLDER_UID}: the API server assigns the real one.\n"]
    for i, doc in enumerate(docs):
        where = f"{args.filename}: document {i + 1}"
        if not isinstance(doc, dict) or (doc.get("apiVersion"), doc.get("kind")) != (f"{GROUP}/{VERSION}", KIND):
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            print(f"error: {where} is a {kind}, not a {GROUP}/{VERSION} {KIND}", file=sys.stderr)
            return 2
        meta = doc.get("metadata") or {}
        name, namespace = meta.get("name"), meta.get("namespace") or args.render_namespace or "default"
        if not isinstance(name, str) or not name:
            print(f"error: {where}: metadata.name: required", file=sys.stderr)
            return 2
        if args.render_namespace and meta.get("namespace") not in (None, args.render_namespace):
            print(f"error: {where}: metadata.namespace {meta['namespace']!r} differs from --namespace "
                  f"{args.render_namespace!r}", file=sys.stderr)
            return 2
        try:
            spec = parse_spec(name, doc.get("spec"))
        except SpecError as e:
            print(f"error: {where} ({KIND} {namespace}/{name}): {e}", file=sys.stderr)
            return 2
        inst = Instance(name=name, namespace=namespace, uid=PLACEHOLDER_UID, spec=spec, defaults=defaults)
        for obj in [*render_all(inst, monitoring_available=True), render_bootstrap_secret(inst, None)]:
            # Through JSON: plain types only (the safe dumper refuses the spec's str and dict subclasses).
            out.append("---\n" + yaml.safe_dump(json.loads(json.dumps(obj)), sort_keys=False, width=100))
    sys.stdout.write("".join(out))
    return 0


def run(args: argparse.Namespace) -> int:
    import kopf
    import kubernetes
    from prometheus_client import start_http_server

    from tandem.operator import handlers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers.configure(_defaults(args))
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
