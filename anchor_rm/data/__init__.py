"""Layer 1, data: preference records into `PreferencePair`s and the protocol's splits. Imports no other layer.

records.py  PreferencePair, DataError, each file format's record source and each dataset layout's parser
readers.py  iter_<format> / read_<format> for every format, and the generic reader (files and hub datasets)
catalog.py  the named datasets (shipped copies, hub names) and each category's source and OOD targets
safety_readers.py  DiaSafety and XSTest, read into pairs
splits.py   cleaning (counted), prompt-disjoint seeded splits, ProtocolSplits
progress.py progress lines for anything that runs long
"""
