"""The OpenAI-compatible server (`pagedlm serve`). Light on purpose: the CLI imports the
defaults below without loading FastAPI."""

import socket

# Answer 503 once this many sequences are waiting to be scheduled.
DEFAULT_MAX_NUM_QUEUED_REQUESTS = 1024
# Bytes; a 128K-token prompt sent as JSON token ids fits.
DEFAULT_MAX_REQUEST_BODY_SIZE = 4 << 20
# Seconds running requests get to finish after SIGTERM/SIGINT (--shutdown-timeout).
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# max_tokens of a request that sets none (--max-tokens-default): a reply, not a whole
# context of thousands of tokens by surprise. Less if the context has less room left.
DEFAULT_MAX_TOKENS = 2048


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the port if the server could not listen on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): is another "
                             f"server running there? Choose another with --port") from None
