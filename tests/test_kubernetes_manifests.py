"""deploy/kubernetes/, checked as far as this machine can without a cluster: every
document is a valid object of the Kubernetes API (the OpenAPI schemas kubernetes-validate
ships, strict: unknown fields fail), every kvstore command the pods run parses with the
CLI (``$(VAR)`` references expanded as the kubelet would, the ConfigMap's TOML loaded
with kvstore's own config loader, the Secret's access file with its parser), and the
objects refer to each other: mounts to declared volumes, volumes to the ConfigMap and
Secret, Services and budgets and policies to pod labels, probes to declared ports, the
etcd members to each other and the masters and nodes to the etcd members."""

from __future__ import annotations

import base64
import re
import secrets
import shlex
import tomllib
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from kvstore.security.access import AccessList
from kvstore_client.cluster_address import parse_etcd_address
from kvstore_client.errors import ConfigError
from kvstore_client.etcd import parse_endpoints
from tests.test_docker_files import check_listening, host_port, image_user, parse_command

KUBE = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"  # the API release the schemas come from (everything used is stable since before it)
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")
POD_IP = "10.244.1.7"  # status.podIP, as the downward API gives it
SERVICE_IP = "10.96.0.12"
SECRET_FILE_MODE = 0o644  # a Secret volume's files when it sets no defaultMode


def load() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(KUBE.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((str(path.relative_to(KUBE)), document))
    return found


DOCUMENTS = load()


def objects(kind: str) -> list[dict]:
    return [d for _, d in DOCUMENTS if d["kind"] == kind]


def named(kind: str, name: str) -> dict:
    matches = [d for d in objects(kind) if d["metadata"]["name"] == name]
    assert len(matches) == 1, f"no {kind} {name!r} in deploy/kubernetes (or several)"
    return matches[0]


def workloads() -> list[dict]:
    return [d for _, d in DOCUMENTS if d["kind"] in WORKLOADS]


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def all_containers(workload: dict) -> list[dict]:
    return pod(workload).get("initContainers", []) + pod(workload)["containers"]


def matching(selector: dict) -> list[dict]:
    """The workloads whose pods carry every label of ``selector`` (a plain map)."""
    assert selector, "an empty selector selects everything"
    return [w for w in workloads() if selector.items() <= pod_labels(w).items()]


def runs_kvstore(container: dict) -> bool:
    """Whether the container runs the image's entrypoint (kvstore) with its args."""
    return container["image"].split(":")[0].rsplit("/", 1)[-1] == "kvstore" and "command" not in container


def kvstore_containers() -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads() for c in pod(w)["containers"] if runs_kvstore(c)]


def uid(workload: dict, container: dict) -> int:
    for context in (container.get("securityContext") or {}, pod(workload).get("securityContext") or {}):
        if "runAsUser" in context:
            return context["runAsUser"]
    return image_user() if container["image"].split(":")[0].endswith("kvstore") else 0


def quantity(text) -> int:
    """A Kubernetes quantity in bytes (10Gi, 512Mi, 1G)."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?|k)?", str(text)).groups()
    factor = {
        None: 1,
        "k": 1000,
        "K": 1000,
        "M": 1000**2,
        "G": 1000**3,
        "T": 1000**4,
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
    }[unit]
    return int(float(number) * factor)


# -- what a container sees: env, files ---------------------------------------------------------
def env_values(workload: dict, container: dict, ordinal: int = 0) -> dict[str, str]:
    """The container's env as the kubelet fills it (downward API fields included)."""
    name = workload["metadata"]["name"]
    fields = {
        "status.podIP": POD_IP,
        "metadata.name": f"{name}-{ordinal}" if workload["kind"] == "StatefulSet" else f"{name}-5f7c9-x2m4q",
    }
    values: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = expand(var["value"], values)
        else:
            values[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return values


def expand(text: str, values: dict[str, str]) -> str:
    """``$(VAR)`` as the kubelet expands it in command, args and env; a VAR the container does
    not define would reach the program literally, so it fails here."""

    def one(match):
        assert match.group(1) in values, f"$({match.group(1)}) is no env var of the container"
        return values[match.group(1)]

    return re.sub(r"\$\((\w+)\)", one, text)


def service_link_env(workload: dict) -> dict[str, str]:
    """The variables the kubelet adds for every Service with a cluster IP unless the pod sets
    enableServiceLinks: false (a Service kvstore-master gives KVSTORE_MASTER_PORT=tcp://...)."""
    if not pod(workload).get("enableServiceLinks", True):
        return {}
    env = {}
    for service in objects("Service"):
        if service["spec"].get("clusterIP") == "None":
            continue
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        ports = service["spec"]["ports"]
        env[f"{prefix}_SERVICE_HOST"], env[f"{prefix}_SERVICE_PORT"] = SERVICE_IP, str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"tcp://{SERVICE_IP}:{ports[0]['port']}"
        for port in ports:
            base = f"{prefix}_PORT_{port['port']}_TCP"
            env.update(
                {
                    base: f"tcp://{SERVICE_IP}:{port['port']}",
                    f"{base}_PROTO": "tcp",
                    f"{base}_PORT": str(port["port"]),
                    f"{base}_ADDR": SERVICE_IP,
                }
            )
            if "name" in port:
                env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
    return env


def volume_at(workload: dict, container: dict, path: str) -> tuple[dict, str, dict]:
    """(the volume, the path inside it, the mount) of ``path`` in ``container``."""
    best = None
    for mount in container.get("volumeMounts", []):
        root = PurePosixPath(mount["mountPath"])
        if PurePosixPath(path) == root or root in PurePosixPath(path).parents:
            if best is None or len(mount["mountPath"]) > len(best["mountPath"]):
                best = mount
    assert best is not None, f"{container['name']}: nothing is mounted at {path}"
    declared = {v["name"]: v for v in pod(workload).get("volumes", [])}
    declared.update(
        {
            t["metadata"]["name"]: {"name": t["metadata"]["name"], "persistentVolumeClaim": {}}
            for t in workload["spec"].get("volumeClaimTemplates", [])
        }
    )
    volume = declared[best["name"]]
    return volume, str(PurePosixPath(path).relative_to(best["mountPath"])), best


def projected_file(volume: dict, inner: str) -> tuple[str, int | None]:
    """The text of file ``inner`` of a configMap or secret volume, and its mode (secrets)."""
    kind = "configMap" if "configMap" in volume else "secret"
    source = volume[kind]
    items = {item["path"]: item for item in source.get("items", [])} or None
    key = items[inner]["key"] if items else inner
    mode = (items[inner].get("mode") if items else None) or source.get("defaultMode", SECRET_FILE_MODE)
    if kind == "configMap":
        data = named("ConfigMap", source["name"]).get("data", {})
    else:
        secret = named("Secret", source["secretName"])
        data = {
            **{k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()},
            **secret.get("stringData", {}),
        }
    assert key in data, f"{kind} {source.get('name') or source.get('secretName')} has no key {key!r}"
    return data[key], (mode if kind == "secret" else None)


def init_steps(container: dict) -> list[list[str]]:
    """The commands an init container runs: its argv, or each command of an ``sh -c`` script."""
    argv = container.get("command", []) + container.get("args", [])
    if argv[:1] == ["sh"] and len(argv) >= 3 and argv[1].startswith("-") and "c" in argv[1]:
        return [shlex.split(part) for part in re.split(r"&&|;|\n", argv[2]) if part.strip()]
    return [argv]


def options(argv: list[str], with_value: str) -> tuple[dict[str, str], list[str]]:
    found, rest, i = {}, [], 1
    while i < len(argv):
        if argv[i] in with_value:
            found[argv[i]], i = argv[i + 1], i + 2
        else:
            rest.append(argv[i])
            i += 1
    return found, rest


def access_file(workload: dict, container: dict, path: str) -> str:
    """The text of the access file ``container`` reads at ``path``, after checking that its
    user can read it and that it is 0600-like (kvstore refuses a group- or other-readable
    one). Secret files are root's, and an fsGroup makes them group-readable; so either the
    container runs as root, or an init container copied the file with install -o/-m."""
    volume, inner, _ = volume_at(workload, container, path)
    if "secret" in volume:
        text, mode = projected_file(volume, inner)
        assert not mode & 0o077, f"mode {mode:04o}: kvstore refuses a file group or others can read"
        assert "fsGroup" not in (pod(workload).get("securityContext") or {}), "fsGroup makes Secret files 0440+"
        assert uid(workload, container) == 0, f"{container['name']} cannot read root's {mode:04o} Secret file"
        return text
    assert "emptyDir" in volume, f"{path}: neither a Secret file nor a copy in an emptyDir"
    for init in pod(workload).get("initContainers", []):
        for step in init_steps(init):
            if step[:1] != ["install"]:
                continue
            flags, (source, target) = options(step, ("-o", "-g", "-m"))
            copy_volume, copy_inner, _ = volume_at(workload, init, target)
            if (copy_volume["name"], copy_inner) != (volume["name"], inner):
                continue
            assert int(flags["-o"]) == uid(workload, container), "the copy belongs to another user"
            assert not int(flags["-m"], 8) & 0o077, f"install -m {flags['-m']}: group or others could read it"
            return access_file(workload, init, source)
    raise AssertionError(f"no init container copies the access file to {path}")


def writable_by(workload: dict, container: dict, path: str) -> bool:
    """Whether ``container``'s user may write in the directory ``path`` when the pod starts."""
    volume, inner, mount = volume_at(workload, container, path)
    if mount.get("readOnly"):
        return False
    if "emptyDir" in volume:  # created 0777
        return True
    for init in pod(workload).get("initContainers", []):
        if uid(workload, init) != 0:
            continue
        for step in init_steps(init):
            if step[:1] == ["chown"]:
                owner, *targets = step[1:]
                for target in targets:
                    target_volume, target_inner, _ = volume_at(workload, init, target)
                    if (target_volume["name"], target_inner) == (volume["name"], inner):
                        return int(owner.split(":")[0]) == uid(workload, container)
    return False


def run(workload: dict, container: dict, tmp_path: Path) -> tuple[str, dict]:
    """Parse what ``container`` runs, with the ConfigMap's file behind --config and the
    Secret's access file (placeholders filled with tokens) behind --auth."""
    env = env_values(workload, container)
    args = [expand(arg, env) for arg in container.get("args", [])]
    for flag in ("--config", "--auth"):
        if flag in args:
            at = args.index(flag) + 1
            if flag == "--config":
                volume, inner, _ = volume_at(workload, container, args[at])
                text = projected_file(volume, inner)[0]
            else:
                text = filled(access_file(workload, container, args[at]))
            copy = tmp_path / flag.strip("-")
            copy.write_text(text)
            copy.chmod(0o600)
            args[at] = str(copy)
    shm_dir = env.get("KVSTORE_SHM_DIR")
    if shm_dir is not None:  # --shm-dir's callback wants the directory: this machine has none there
        assert writable_by(workload, container, shm_dir), f"uid {uid(workload, container)} cannot write {shm_dir}"
        (tmp_path / "shm").mkdir(exist_ok=True)
        env = {**env, "KVSTORE_SHM_DIR": str(tmp_path / "shm")}
    params = parse_command(args, {**service_link_env(workload), **env}).params
    check_listening(args[0], params, params.get("auth_file"))
    return args[0], params


def filled(access_text: str) -> str:
    """The access file with each placeholder secret replaced by a fresh token."""
    return re.sub(r'secret = "[^"]*"', lambda _: f'secret = "{secrets.token_urlsafe(32)}"', access_text)


# -- the etcd members --------------------------------------------------------------------------
def etcd_sets() -> list[dict]:
    return [w for w in objects("StatefulSet") if any("coreos/etcd" in c["image"] for c in all_containers(w))]


def etcd_flags(workload: dict, ordinal: int) -> dict[str, str]:
    (container,) = pod(workload)["containers"]
    env = env_values(workload, container, ordinal)
    return dict(expand(arg, env).split("=", 1) for arg in container["args"])


def port_number(container: dict, name_or_number) -> int:
    for port in container.get("ports", []):
        if name_or_number in (port.get("name"), port["containerPort"]):
            return port["containerPort"]
    raise AssertionError(f"{container['name']} declares no port {name_or_number!r}")


def etcd_members() -> set[str]:
    """HOST:PORT of every etcd member's client port, by its stable name under the headless Service."""
    members = set()
    for workload in etcd_sets():
        service = named("Service", workload["spec"]["serviceName"])
        assert service["spec"].get("clusterIP") == "None", "member names need a headless Service"
        (container,) = pod(workload)["containers"]
        client = port_number(container, "client")
        assert any(
            p["port"] == client and port_number(container, p.get("targetPort", p["port"])) == client
            for p in service["spec"]["ports"]
        ), "the Service exposes the client port as itself"
        for ordinal in range(workload["spec"]["replicas"]):
            members.add(f"{workload['metadata']['name']}-{ordinal}.{service['metadata']['name']}:{client}")
    return members


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "where,document", DOCUMENTS, ids=[f"{where}:{d['kind']}/{d['metadata']['name']}" for where, d in DOCUMENTS]
)
def test_every_document_is_a_valid_kubernetes_object(where, document):
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where}: {document['kind']}/{document['metadata']['name']}: {exc.message}")


def test_the_set_has_etcd_two_masters_nodes_on_every_machine_a_config_map_and_a_secret():
    kinds = {(w["kind"], c["args"][0]) for w, c in kvstore_containers()}
    assert kinds == {("Deployment", "master"), ("DaemonSet", "node")}
    (masters,) = [w for w, c in kvstore_containers() if c["args"][0] == "master"]
    assert masters["spec"]["replicas"] == 2
    assert etcd_sets() and objects("ConfigMap") and objects("Secret")
    for _, document in DOCUMENTS:
        assert "namespace" not in document["metadata"], "the user picks the namespace (kubectl -n)"


@pytest.mark.parametrize(
    "workload,container",
    kvstore_containers(),
    ids=[f"{w['metadata']['name']}/{c['name']}" for w, c in kvstore_containers()],
)
def test_every_kvstore_command_parses_and_is_wired_to_etcd(workload, container, tmp_path):
    name, params = run(workload, container, tmp_path)
    declared = {p["containerPort"] for p in container["ports"]}
    assert {params["port"], params["metrics_port"]} <= declared, "the ports it listens on are declared"
    if name == "master":
        assert params["etcd_endpoints"] and set(parse_endpoints(params["etcd_endpoints"])) <= etcd_members()
        assert params["advertise"], "without --advertise a master puts 0.0.0.0:PORT in etcd"
        assert host_port(params["advertise"]) == (POD_IP, params["port"])
    else:
        endpoints, _ = parse_etcd_address(params["master_address"])
        assert set(endpoints) <= etcd_members()
        assert params["advertise"] == POD_IP
        assert env_values(workload, container).get("KVSTORE_SHM_DIR"), "the arena in the volume engines share"
        assert writable_by(workload, container, params["data_dir"]), f"uid {uid(workload, container)}: data dir"
        limit = quantity(container["resources"]["limits"]["memory"])
        assert limit >= params["dram"] + (1 << 30), "the DRAM arena is charged to the pod: leave room beside it"


def test_nodes_and_masters_name_the_same_election(tmp_path):
    ran = [run(w, c, tmp_path) for w, c in kvstore_containers()]
    masters = {(p["etcd_endpoints"], p["etcd_prefix"]) for name, p in ran if name == "master"}
    assert len(masters) == 1
    ((endpoints, prefix),) = masters
    for name, params in ran:
        if name == "node":
            assert parse_etcd_address(params["master_address"]) == (parse_endpoints(endpoints), prefix)


def test_the_config_map_names_only_commands_the_pods_run_with_it():
    for config_map in objects("ConfigMap"):
        for key, text in config_map["data"].items():
            tables = set(tomllib.loads(text))
            users = {
                c["args"][0]
                for w, c in kvstore_containers()
                if "--config" in c["args"]
                and volume_at(w, c, c["args"][c["args"].index("--config") + 1])[0].get("configMap", {}).get("name")
                == config_map["metadata"]["name"]
            }
            assert tables <= users, f"{key}: tables no pod reads: {sorted(tables - users)}"


def test_the_etcd_members_bootstrap_one_cluster():
    for workload in etcd_sets():
        name, service = workload["metadata"]["name"], workload["spec"]["serviceName"]
        (container,) = pod(workload)["containers"]
        replicas = workload["spec"]["replicas"]
        for ordinal in range(replicas):
            flags = etcd_flags(workload, ordinal)
            member = f"{name}-{ordinal}"
            initial = dict(entry.split("=", 1) for entry in flags["--initial-cluster"].split(","))
            assert set(initial) == {f"{name}-{i}" for i in range(replicas)}
            assert flags["--name"] == member
            peer = f"http://{member}.{service}:{port_number(container, 'peer')}"
            assert initial[member] == flags["--initial-advertise-peer-urls"] == peer
            assert flags["--advertise-client-urls"] == f"http://{member}.{service}:{port_number(container, 'client')}"
            assert flags["--listen-client-urls"].endswith(f":{port_number(container, 'client')}")
            assert flags["--listen-peer-urls"].endswith(f":{port_number(container, 'peer')}")
            volume, _, _ = volume_at(workload, container, flags["--data-dir"])
            assert "persistentVolumeClaim" in volume, "etcd's data outlives its pod"


def test_every_volume_mount_names_a_declared_volume_and_every_volume_is_used():
    for workload in workloads():
        declared = {v["name"] for v in pod(workload).get("volumes", [])}
        declared |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        used = set()
        for container in all_containers(workload):
            paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
            assert len(paths) == len(set(paths)), f"{container['name']}: two mounts at one path"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in declared, f"{workload['metadata']['name']}: no volume {mount['name']!r}"
                used.add(mount["name"])
        assert declared <= used, f"{workload['metadata']['name']}: volumes nothing mounts: {declared - used}"
        for volume in pod(workload).get("volumes", []):
            if "configMap" in volume:
                named("ConfigMap", volume["configMap"]["name"])
            if "secret" in volume:
                named("Secret", volume["secret"]["secretName"])


def test_selectors_match_pod_labels_and_target_ports_exist():
    for workload in workloads():
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod_labels(workload).items()
    for service in objects("Service"):
        selected = matching(service["spec"]["selector"])
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for workload in selected:
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert any(
                    target in (p.get("name"), p["containerPort"])
                    for c in pod(workload)["containers"]
                    for p in c.get("ports", [])
                ), f"Service {service['metadata']['name']}: {workload['metadata']['name']} has no port {target!r}"
    for budget in objects("PodDisruptionBudget"):
        assert matching(budget["spec"]["selector"]["matchLabels"]), f"{budget['metadata']['name']} selects nothing"
    for workload in objects("StatefulSet"):
        service = named("Service", workload["spec"]["serviceName"])
        assert workload in matching(service["spec"]["selector"])


def test_the_network_policy_lets_in_every_pod_that_names_etcd_and_only_ports_that_exist(tmp_path):
    policies = objects("NetworkPolicy")
    for policy in policies:
        for workload in matching(policy["spec"]["podSelector"]["matchLabels"]):
            (container,) = pod(workload)["containers"]
            for rule in policy["spec"]["ingress"]:
                for port in rule["ports"]:
                    port_number(container, port["port"])
                for source in rule["from"]:
                    assert matching(source["podSelector"]["matchLabels"]), "a rule no pod of the set matches"
    (etcd,) = etcd_sets()
    (etcd_container,) = pod(etcd)["containers"]
    guarding = [p for p in policies if etcd in matching(p["spec"]["podSelector"]["matchLabels"])]
    assert guarding, "etcd checks no credentials: a policy must keep others away from it"
    for workload, _ in kvstore_containers():
        admitted = any(
            rule["from"][0]["podSelector"]["matchLabels"].items() <= pod_labels(workload).items()
            and any(
                port_number(etcd_container, p["port"]) == port_number(etcd_container, "client") for p in rule["ports"]
            )
            for policy in guarding
            for rule in policy["spec"]["ingress"]
        )
        assert admitted, f"{workload['metadata']['name']} could not reach etcd's client port"


def test_probes_name_ports_their_container_declares():
    for workload in workloads():
        for container in pod(workload)["containers"]:
            probes = [container[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container]
            assert probes, f"{container['name']} has no probes"
            for probe in probes:
                (handler,) = [probe[k] for k in ("tcpSocket", "httpGet", "grpc") if k in probe]
                port_number(container, handler["port"])
                if "httpGet" in probe and container["name"] != "etcd":  # no token: kvstore's /health only
                    assert handler["path"] == "/health", f"{container['name']} probes {handler['path']}"


def test_kvstore_pods_run_as_the_image_user_with_resources_and_one_image():
    images = set()
    for workload, container in kvstore_containers():
        context = pod(workload)["securityContext"]
        assert context["runAsUser"] == image_user() and context["runAsNonRoot"] is True
        assert {"requests", "limits"} <= set(container["resources"])
        images |= {c["image"] for c in all_containers(workload)}
    assert len(images) == 1, f"init and service containers should share one image: {images}"


def test_the_example_secret_carries_no_usable_tokens_but_the_shape_kvstore_loads():
    for secret in objects("Secret"):
        text = secret["stringData"]["access.toml"]
        with pytest.raises(ConfigError, match="at least 16 characters"):
            AccessList.parse(tomllib.loads(text))
        access = AccessList.parse(tomllib.loads(filled(text)))
        assert access.service_token() is not None, "nodes need a node token held in full"
        roles = {p.role for p in access.principals()}
        assert {"admin", "node"} <= roles
