"""msgspec Structs for the wire: ACP messages, our extensions, and error payloads."""
