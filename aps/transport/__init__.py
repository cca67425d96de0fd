"""Transports: how frames move between workers and the server.

``framing`` holds the one frame parser every transport and both ends use;
``tcp`` drives it over TCP sockets.
"""
