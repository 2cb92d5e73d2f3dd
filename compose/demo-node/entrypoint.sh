#!/bin/sh
# The demo node's start: its own host key, kept in the node's volume so it survives the container being
# recreated (a new key would rightly block the node until an admin approves it again), then sshd.
set -e
KEYS=/var/lib/demo-node/ssh
mkdir -p "$KEYS" /run/sshd
if [ ! -s "$KEYS/ssh_host_ed25519_key" ]; then
  ssh-keygen -q -t ed25519 -N "" -C "$(hostname)" -f "$KEYS/ssh_host_ed25519_key"
fi
ln -sf "$KEYS/ssh_host_ed25519_key" /etc/ssh/ssh_host_ed25519_key
ln -sf "$KEYS/ssh_host_ed25519_key.pub" /etc/ssh/ssh_host_ed25519_key.pub
exec /usr/sbin/sshd -D -e
