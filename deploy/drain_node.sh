#!/usr/bin/env bash
# preStop hook of a Ray worker pod (deploy/rayservice.yaml): drain this node before Kubernetes stops it.
#
# Asks Ray's GCS to drain the node (the reason Ray's autoscaler uses for preemption): Serve starts
# replacement replicas on other nodes and stops the ones here gracefully (graceful_shutdown_timeout_s,
# 65 s: every accepted request finishes; docs/deploy.md#graceful-shutdown-and-redeploys). Then waits
# until no Serve replica process is left on this node, or DRAIN_WAIT_S (default 80) pass, so that the
# pod's terminationGracePeriodSeconds (90) must exceed DRAIN_WAIT_S.
set -u
wait_s="${DRAIN_WAIT_S:-80}"
title="${REPLICA_TITLE:-ray::ServeReplica}"   # the process title of a Serve replica
ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "pod terminating (preStop)" \
    --deadline-remaining-seconds "$wait_s" || echo "drain_node: ray drain-node failed; waiting anyway" >&2
replicas_here() {   # a Serve replica process on this node (its title, from /proc: no procps in the image)
    grep -qsaF "$title" /proc/[0-9]*/cmdline
}
end=$((SECONDS + wait_s))
while [ "$SECONDS" -lt "$end" ] && replicas_here; do
    sleep 1
done
