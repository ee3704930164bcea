#!/usr/bin/env bash
# The etcd roles a kvstore pool needs, bound to client certificates (the certificate's CN is
# the etcd user; run etcd with --client-cert-auth and a --trusted-ca-file), then auth on:
#
#   deploy/etcd-roles.sh PREFIX MASTERS NODES CLIENTS
#   deploy/etcd-roles.sh /kvstore master1,master2 node1,node2,node3 engine,ops
#
# masters: read and write PREFIX/leader (the election); nodes: read it, and read and write
# their id claims under PREFIX/nodes/; clients (engines, tenants, `kvstore status`): read
# PREFIX/leader only. The user "root" (CN=root) keeps the root role. etcdctl is run as
# $ETCDCTL (default: etcdctl), which must carry the endpoint and a root certificate, e.g.
#   ETCDCTL="etcdctl --endpoints https://10.0.0.1:2379 --cacert ca.pem --cert root.pem --key root.key"
# Run it once, before the masters start; running it again on an etcd with auth on fails at
# the first role that exists (remove them with etcdctl role delete to start over).
set -euo pipefail
if [ $# -ne 4 ]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
prefix=${1%/} masters=$2 nodes=$3 clients=$4
ctl() { ${ETCDCTL:-etcdctl} "$@" >/dev/null; }
ctl role add kvstore-master
ctl role grant-permission kvstore-master readwrite "$prefix/leader"
ctl role add kvstore-node
ctl role grant-permission kvstore-node read "$prefix/leader"
ctl role grant-permission kvstore-node readwrite --prefix "$prefix/nodes/"
ctl role add kvstore-client
ctl role grant-permission kvstore-client read "$prefix/leader"
users() { # ROLE USER,USER,...
  local role=$1 user
  IFS=, read -ra list <<<"$2"
  for user in "${list[@]}"; do
    [ -n "$user" ] || continue
    ctl user add "$user" --no-password
    ctl user grant-role "$user" "$role"
  done
}
users kvstore-master "$masters"
users kvstore-node "$nodes"
users kvstore-client "$clients"
ctl user add root --no-password
ctl user grant-role root root
ctl auth enable
echo "etcd roles for $prefix: masters $masters; nodes $nodes; clients $clients; auth enabled"
