# The standard library a data-minded cell reaches for first.
import csv, datetime, io, json, re, statistics
from decimal import Decimal, getcontext
from fractions import Fraction

data = [2.5, 3.5, 4.0, 4.5, 5.5]
print("mean", statistics.mean(data), "median", statistics.median(data))
print("stdev", round(statistics.stdev(data), 6))
getcontext().prec = 30
print("1/7 =", Decimal(1) / Decimal(7))
print("0.1+0.2 =", Decimal("0.1") + Decimal("0.2"))
print("harmonic H5 =", sum(Fraction(1, k) for k in range(1, 6)))
print(re.findall(r"\b(\w+)@(\w+)\.org\b", "ada@python.org, bob@r-project.com, cy@gnu.org"))
doc = json.loads('{"name": "sandcell", "langs": ["python", "r"], "cells": 3}')
print(json.dumps(doc, sort_keys=True))
rows = list(csv.DictReader(io.StringIO("city,temp\nOslo,-3\nLima,19\nCairo,24\n")))
print(max(rows, key=lambda r: int(r["temp"]))["city"], sum(int(r["temp"]) for r in rows))
d = datetime.date(2024, 2, 28) + datetime.timedelta(days=2)
print(d.isoformat(), d.strftime("%A"))
