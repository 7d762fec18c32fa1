"""Users' own work as Arbor takes it: datasets (``files``, ``prompts``), reward functions
(``rewards``), tools (``tools``), and the ``Source`` a job trains on (``source``)."""
