"""``spindle compare``: the command and its table (``cli``), the row explanations (``explain``), MFU and the
analytic curves' band (``band``)."""
