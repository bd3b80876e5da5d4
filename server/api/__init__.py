"""The HTTP side: Flask app, OpenAI schema and replies, metrics, adapter lifecycle, peer fetch."""
