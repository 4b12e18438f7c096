#!/usr/bin/env bash
# Installs the Debian packages Floe needs, only those missing.
#   build:  protobuf-compiler (etcd-client generates its gRPC code at build time),
#           libssl-dev and pkg-config (OpenSSL serves NBD's TLS-PSK)
#   test:   the real NBD clients and tools the end-to-end tests drive, the NFS
#           clients (libnfs-utils: nfs-ls, nfs-cp; qemu-block-extra: QEMU's nfs
#           driver), etcd,
#           nftables and iproute2 (network cuts, hosts as network namespaces),
#           socat (a service address that follows a session between gateways),
#           systemd (systemd-analyze checks deploy/systemd), ceph-base for crushtool
#           (placement is checked bit-exact against it)
#   bench:  what bench/run compares against and draws with: fio, nbdkit, etcd and
#           qemu-io (--failover), Ceph 16
#           (mon, osd, mgr, librbd for fio's rbd engine), matplotlib, strace
set -euo pipefail
want=(protobuf-compiler libssl-dev pkg-config)
case "${1:-}" in
  --test) want+=(fio qemu-utils qemu-block-extra libnfs-utils nbdkit libnbd-bin python3-libnbd fuse3 etcd-server e2fsprogs util-linux nftables iproute2 socat systemd ceph-base) ;;
  --bench) want+=(fio nbdkit etcd-server qemu-utils ceph-mon ceph-osd ceph-mgr ceph-common librbd1 python3 python3-matplotlib strace) ;;
  "") ;;
  *) echo "usage: $0 [--test|--bench]" >&2; exit 2 ;;
esac
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing packages: ${missing[*]}; install them (apt-get install ${missing[*]}) or run as root" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
