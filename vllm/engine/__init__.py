"""The engine: argument parsing (`arg_utils`), the engine-core process (`core`), the client the
front ends use to talk to it (`core_client`), and front-end output processing."""
