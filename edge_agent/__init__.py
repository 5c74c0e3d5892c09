"""edge_agent: the site agent (any tier). Needs the ``agent`` extra (``pip install 'tiermesh[agent]'``)."""

from mesh.extras import require

require("agent", "grpclib", "zmq", "msgpack", "onnxruntime")
