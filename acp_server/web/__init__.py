"""The web console's files (HTML, CSS, JavaScript modules), served by ``transports/http/console.py``."""
