import json


def parse_sse(text: str) -> list[tuple[str, object]]:
    """(event name, data) per server-sent event; data decoded from JSON unless [DONE]."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = "message", None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                raw = line[len("data: ") :]
                data = raw if raw == "[DONE]" else json.loads(raw)
        events.append((name, data))
    return events
