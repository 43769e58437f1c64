# Sourced by the launch scripts: MASTER_PORT, or a TCP port the OS reports free, so that two jobs
# started together on one machine never meet in one rendezvous (DeepSpeed's and torchrun's
# default port is the same for every job).
job_port() {
  if [ -n "${MASTER_PORT:-}" ]; then echo "$MASTER_PORT"; return; fi
  "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
